#!/usr/bin/env bash
# The lint step scripts/test.sh runs before the tests: ruff (style, pyflakes, import order,
# bugbear, pyupgrade; configured in pyproject.toml), the formatter's check, and mypy on the
# core and the stage packages, then the docs checks (lmforge.reference) and the MkDocs site build.
# Fix formatting with `.venv/bin/ruff format .`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m ruff format --check --quiet . || { echo "ruff format: files above need formatting (.venv/bin/ruff format .)" >&2; exit 1; }
# mypy (one process, about 40 s without its cache) beside the docs checks: two cores, two checks
mypy_log=$(mktemp)
"$PY" -m mypy > "$mypy_log" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_log"' EXIT
# the docs: the generated references are current, every --set / config YAML / `lmforge` command in
# README.md and docs/ validates, and the site builds with no broken link or anchor
"$PY" -m lmforge.reference check
if [ -x .venv-docs/bin/mkdocs ]; then
  # not --quiet: it hides the warnings --strict counts, and a broken link would pass
  built=$(NO_MKDOCS_2_WARNING=1 .venv-docs/bin/mkdocs build --strict --site-dir "${LMFORGE_SITE_DIR:-site}" 2>&1) \
    || { echo "$built" | grep -v '^INFO' >&2; echo "lint: mkdocs build --strict failed" >&2; exit 1; }
elif [ "${CI:-}" = true ]; then
  echo "lint: .venv-docs is missing (scripts/setup.sh makes it): the docs site was not built" >&2; exit 1
else
  echo "lint: skipped the docs site build (.venv-docs is missing; scripts/setup.sh makes it)" >&2
fi
mypy_rc=0
wait "$mypy_pid" || mypy_rc=$?
cat "$mypy_log"
[ "$mypy_rc" = 0 ] || { echo "lint: mypy failed" >&2; exit 1; }
echo "lint: ruff, mypy and the docs passed"
