#!/usr/bin/env bash
# Install everything, then run the main job on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/hypha demo "$@"
