#!/usr/bin/env bash
# Create .venv beside this checkout and install smoltorrent into it.
# Usage: scripts/bootstrap.sh [coordinator|test|node]
#   coordinator (default): the training machine's side, everything the demo needs
#   test: the coordinator plus the test tools; node: a storage node only (standard library)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "smoltorrent needs Python 3.11 or newer ($python is older or missing)." >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
case "${1:-coordinator}" in
    node) spec="." ;;
    coordinator | test) spec=".[${1:-coordinator}]" ;;
    *) echo "usage: scripts/bootstrap.sh [coordinator|test|node]" >&2; exit 2 ;;
esac
.venv/bin/python -m pip install --quiet -e "$spec"
# Bytecode for smoltorrent's own modules now: an editable install leaves it to the first
# import, which writes none where PYTHONDONTWRITEBYTECODE is set, and then every command
# compiles them again (0.1 s of each CLI start). A wheel install compiles them already.
.venv/bin/python -m compileall -q smoltorrent coordinator worker_server tasks beat > /dev/null
