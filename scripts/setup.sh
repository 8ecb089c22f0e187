#!/usr/bin/env bash
# Create .venv and install tessera with everything the demo and the tests need.
# Idempotent: a second run only checks that the environment is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.tessera-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: the CPU wheel of 2.13.0 is what this project is tested on.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[test,interop]"
    echo "$want" > "$stamp"
fi
