#!/usr/bin/env bash
# Set up (if needed), lint (scripts/lint.sh), and run the whole test suite: unit tests, the curation pipeline, real
# 2-rank DeepSpeed training on CPU, Prefect flows against a temporary Prefect server, and the
# tiny-cpu pipeline end to end through the CLI. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LMFORGE_LLAMACPP_ENV=${LMFORGE_LLAMACPP_ENV:-1} bash scripts/setup.sh  # the GGUF tests need llama.cpp
# The lint runs beside the tests, its report printed after theirs: it is mostly one process (mypy, the
# docs build) and would leave a core idle for a minute before the tests start. Either failing fails.
lint_log=$(mktemp)
bash scripts/lint.sh > "$lint_log" 2>&1 &
lint_pid=$!
trap 'kill "$lint_pid" 2>/dev/null || true; rm -f "$lint_log"' EXIT
# pytest-xdist workers (tests/conftest.py spreads the files over them, longest first; each stage of the
# shared lineage is built once); `-n 0` in the arguments runs everything in one process
rc=0
.venv/bin/python -m pytest -q -n "${LMFORGE_TEST_WORKERS:-2}" --dist loadgroup "$@" || rc=$?
lint_rc=0
wait "$lint_pid" || lint_rc=$?
cat "$lint_log"
if [ "$lint_rc" != 0 ]; then
  echo "scripts/lint.sh failed (exit $lint_rc): its report is above" >&2
  [ "$rc" != 0 ] || rc=$lint_rc
fi
exit "$rc"
