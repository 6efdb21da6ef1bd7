#!/usr/bin/env bash
# Create .venv-peers: the libraries benchmarks/curation.py compares lmforge's curation with
# (datasketch, rensa, datatrove). They live apart from .venv so that nothing they pull in can
# change the project's pinned environment. Running it again is a no-op.
#
#   bash scripts/setup_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv-peers
# datasketch and numpy pinned as in requirements/cpu.lock, so the datasketch baseline is
# the same code in both environments; datatrove pinned to the version whose filters heuristics.py follows.
PEERS=(datasketch==2.0.0 numpy==2.3.5 xxhash rensa==0.5.0 "datatrove[processing]==0.10.1" orjson spacy psutil)

want=$(printf '%s\n' "${PEERS[@]}" | sha256sum | cut -d' ' -f1)
stamp="$VENV/.peers-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "peer environment is up to date ($VENV)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "installing ${PEERS[*]} into $VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "${PEERS[@]}"
"$VENV/bin/python" -c "import datasketch, rensa, datatrove, orjson, spacy, xxhash; print('peers ok: datatrove', datatrove.__version__ if hasattr(datatrove, '__version__') else '')"
echo "$want" > "$stamp"
