#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh all
# setup.sh installed the interop extra: an interop test that cannot find its framework fails
# here instead of skipping (tests/conftest.py), so a broken install is never a green run.
export TESSERA_REQUIRE_INTEROP=${TESSERA_REQUIRE_INTEROP:-1}
# Lint, format and types first (pyproject.toml configures them): seconds, and a failure names the line.
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
.venv/bin/python -m mypy
# The layers of tessera/ and no import cycles ([tool.importlinter] in pyproject.toml, docs/architecture.md).
if .venv/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    .venv/bin/lint-imports --no-cache
else
    echo "note: import-linter needs Python >= 3.11; the layers contract was not checked" >&2
fi
set +e
# Two workers (pytest-xdist): the suite's tests wait on processes, sockets and timeouts about
# half the time; one at a time it took 17-18 min on this 2-core machine, on two 12-13 min.
# TESSERA_TEST_WORKERS=0 runs it in one process.
workers=${TESSERA_TEST_WORKERS:-2}
if [ "$workers" = "0" ]; then
    .venv/bin/python -m pytest "$@"
else
    .venv/bin/python -m pytest -n "$workers" --dist worksteal "$@"
fi
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
