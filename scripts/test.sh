#!/usr/bin/env bash
# Set up (if needed), lint (scripts/lint.sh), and run the whole test suite: unit tests, the curation pipeline, real
# 2-rank DeepSpeed training on CPU, Prefect flows against a temporary Prefect server, and the
# tiny-cpu pipeline end to end through the CLI. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite's processes keep the bytecode of what they import (in the project's own environments and
# folders, once): with PYTHONDONTWRITEBYTECODE set, each of its ~1,000 Python processes compiled every
# module it imported from a source file again (a quantization process 13 s of CPU instead of 6).
unset PYTHONDONTWRITEBYTECODE
# The GGUF tests need llama.cpp: its compile (about 2 minutes of both cores) is the longest part of setup
# on a fresh clone, so it runs in its own session from the start, beside the other environments' installs
# and then the lint (which needs only .venv and .venv-docs), and is waited for before the tests.
llamacpp_pid="" llamacpp_log=""
if [ "${LMFORGE_LLAMACPP_ENV:-1}" = 1 ]; then
  llamacpp_log=$(mktemp)
  setsid -w bash scripts/setup.sh --llamacpp > "$llamacpp_log" 2>&1 &
  llamacpp_pid=$!
  # a failed install or lint stops the build with it (its whole process group: pip, cmake, the compilers)
  trap '[ -z "$llamacpp_pid" ] || kill -- "-$llamacpp_pid" 2> /dev/null || true; rm -f "$llamacpp_log"' EXIT
fi
LMFORGE_LLAMACPP_ENV=0 bash scripts/setup.sh
bash scripts/lint.sh
if [ -n "$llamacpp_pid" ]; then
  rc=0
  wait "$llamacpp_pid" || rc=$?
  llamacpp_pid=""
  cat "$llamacpp_log"; rm -f "$llamacpp_log"
  [ "$rc" = 0 ] || { echo "building .venv-llamacpp failed (exit $rc)" >&2; exit "$rc"; }
fi
# two pytest-xdist workers (tests/conftest.py groups the tests: the shared lineage on one worker,
# every other file whole); `-n 0` in the arguments runs everything in one process
exec .venv/bin/python -m pytest -q -n "${LMFORGE_TEST_WORKERS:-2}" --dist loadgroup "$@"
