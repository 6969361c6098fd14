#!/usr/bin/env bash
# Create .venv (if needed) and install Hypha with everything it needs, pinned
# by constraints.txt. torch==2.13.0 is the CPU wheel from the local disk;
# GPU users install their CUDA build of torch first and drop that pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.hypha-installed
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install --quiet torch==2.13.0
  .venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
  echo "$want" > "$stamp"
fi
