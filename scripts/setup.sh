#!/usr/bin/env bash
# Create .venv and install tessera into it. One argument chooses how much:
#   core  the package and its dependencies (torch, numpy, safetensors, ...): what the demo needs.
#   all   (default) core, plus the test tools and the real frameworks of the `interop` extra
#         (DeepSpeed, megatron-core, Lightning, Accelerate, torchtitan) that the interop tests
#         train with.
# Idempotent: a second run only checks a stamp. Each mode has its own stamp, so they run in
# either order; `all` also stamps `core`, since it installs a superset.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
case "$mode" in
    core | all) ;;
    *)
        echo "usage: bash scripts/setup.sh [core|all]  (got '$mode')" >&2
        exit 2
        ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
want=$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1)
is_done() { [ "$(cat ".venv/.tessera-setup-$1" 2>/dev/null)" = "$want" ]; }
stamp() { echo "$want" > ".venv/.tessera-setup-$1"; }
pin=(-c scripts/constraints.txt)  # torch stays at the tested version whatever a package asks for

if ! is_done core && ! is_done all; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: the CPU wheel of 2.13.0 is what this project is tested on.
    .venv/bin/python -m pip install -q "${pin[@]}" "torch==2.13.0"
    .venv/bin/python -m pip install -q "${pin[@]}" -e .
    stamp core
fi
if [ "$mode" = all ] && ! is_done all; then
    .venv/bin/python -m pip install -q "${pin[@]}" -e ".[test]"
    # The interop extra, one requirement per line in pyproject.toml. DeepSpeed's setup.py imports
    # torch, so it builds without isolation (against the torch above) and with its C++/CUDA ops
    # left to be built just in time (DS_BUILD_OPS=0): the CPU paths the tests use need none.
    # Everything else in the extra installs the ordinary way.
    mapfile -t interop < <(.venv/bin/python -c '
import re, tomllib
with open("pyproject.toml", "rb") as f:
    reqs = tomllib.load(f)["project"]["optional-dependencies"]["interop"]
ds = [r for r in reqs if re.match(r"deepspeed\b", r.strip(), re.I)]
print("\n".join(["DS"] + ds + ["REST"] + [r for r in reqs if r not in ds]))')
    split=0
    for i in "${!interop[@]}"; do [ "${interop[$i]}" = REST ] && split=$i; done
    deepspeed=("${interop[@]:1:$((split - 1))}")
    rest=("${interop[@]:$((split + 1))}")
    .venv/bin/python -m pip install -q "${pin[@]}" "setuptools>=77" wheel
    if [ ${#rest[@]} -gt 0 ]; then
        .venv/bin/python -m pip install -q "${pin[@]}" "${rest[@]}"
    fi
    if [ ${#deepspeed[@]} -gt 0 ]; then
        DS_BUILD_OPS=0 .venv/bin/python -m pip install -q "${pin[@]}" --no-build-isolation "${deepspeed[@]}"
    fi
    stamp all
    stamp core
fi
