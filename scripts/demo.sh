#!/usr/bin/env bash
# The main job on a fresh machine: install, then run a complete local cluster
# (embedded Redis, 4 nodes, a Celery worker), store, kill a node, gather, verify.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/smoltorrent demo "$@"
