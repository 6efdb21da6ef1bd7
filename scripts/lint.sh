#!/usr/bin/env bash
# The lint step scripts/test.sh runs before the tests: ruff (style, pyflakes, import order,
# bugbear, pyupgrade; configured in pyproject.toml), the formatter's check, and mypy on the
# core and the stage packages. Fix formatting with `.venv/bin/ruff format .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m ruff format --check --quiet . || { echo "ruff format: files above need formatting (.venv/bin/ruff format .)" >&2; exit 1; }
"$PY" -m mypy
echo "lint: ruff and mypy passed"
