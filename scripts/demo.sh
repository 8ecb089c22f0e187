#!/usr/bin/env bash
# Set up (if needed) and run the demo: train across 2 processes, save, reshard, resume.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh core  # the package and what the demo needs; tests: setup.sh all
exec .venv/bin/python examples/demo.py "$@"
