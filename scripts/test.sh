#!/usr/bin/env bash
# Install everything (Compose v2 too where Docker runs), then run the whole
# check: generated-code freshness, ruff, mypy, and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The container tests (tests/containers/) need Compose v2 (testcontainers drives
# `docker compose`): installed as .ci/run does, wherever Docker runs. Without
# Docker they skip with the reason.
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  bash scripts/compose-plugin.sh
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
.venv/bin/python scripts/genproto.py --check
.venv/bin/python scripts/configref.py --check
.venv/bin/ruff format --check libs services tests benchmarks scripts
.venv/bin/ruff check libs services tests benchmarks scripts
.venv/bin/mypy
.venv/bin/pytest -q --durations=25 "$@"
