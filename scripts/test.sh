#!/usr/bin/env bash
# Install everything, then run the whole check: generated-code freshness,
# ruff, mypy, and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
.venv/bin/python scripts/genproto.py --check
.venv/bin/python scripts/configref.py --check
.venv/bin/ruff format --check libs services tests benchmarks scripts
.venv/bin/ruff check libs services tests benchmarks scripts
.venv/bin/mypy
.venv/bin/pytest -q --durations=25 "$@"
