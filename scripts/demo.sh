#!/usr/bin/env bash
# Set up (if needed) and run the whole pipeline on the embedded default: the tiny-cpu preset on
# the built-in demo corpus. Extra arguments go to `lmforge run` (e.g. --workspace DIR, --set K=V).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lmforge run "$@"
