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
want=$(cat scripts/setup.sh pyproject.toml services/*/pyproject.toml libs/testing/pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install --quiet torch==2.13.0
  # The core (libs/), every role (services/<role>/) and the test harness
  # (libs/testing/, which drives the roles), each its own distribution
  # contributing to the ``hypha`` namespace package.
  # editable_mode=compat: plain .pth path entries (no import hooks), which editors and type checkers follow.
  .venv/bin/python -m pip install --quiet --config-settings editable_mode=compat -c constraints.txt -e '.[torch,dev]' \
    -e services/gateway -e services/scheduler -e 'services/data[prepare]' \
    -e services/worker -e 'services/client[demo]' -e libs/testing
  echo "$want" > "$stamp"
fi
# System packages (bubblewrap for the workers' job sandbox, Chromium for the
# status page's browser test): installed when we can (root with apt), else
# named so you can install them yourself.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  bash scripts/system-deps.sh
elif ! command -v bwrap >/dev/null 2>&1; then
  echo "note: install bubblewrap (e.g. sudo apt-get install bubblewrap) or set worker.jobs.sandbox = \"none\"; workers refuse to start without a sandbox" >&2
fi
