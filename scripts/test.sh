#!/usr/bin/env bash
# Set up (if needed), lint (scripts/lint.sh), and run the whole test suite: unit tests, the curation pipeline, real
# 2-rank DeepSpeed training on CPU, Prefect flows against a temporary Prefect server, and the
# tiny-cpu pipeline end to end through the CLI. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
LMFORGE_LLAMACPP_ENV=${LMFORGE_LLAMACPP_ENV:-1} bash scripts/setup.sh  # the GGUF tests need llama.cpp
bash scripts/lint.sh
# two pytest-xdist workers (tests/conftest.py groups the tests: the shared lineage on one worker,
# every other file whole); `-n 0` in the arguments runs everything in one process
exec .venv/bin/python -m pytest -q -n "${LMFORGE_TEST_WORKERS:-2}" --dist loadgroup "$@"
