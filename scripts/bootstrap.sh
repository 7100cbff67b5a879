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
# --no-compile, then compileall on every core (-j 0): pip compiles what it installs one
# file at a time, 29 s for the test extras' 8,900 files on the 2-core CI box against 19 s.
.venv/bin/python -m pip install --quiet --no-compile -e "$spec"
# A file that does not compile (some packages ship ones for other Pythons) is skipped, as
# pip skips it; compileall then exits 1, which says nothing wrong with the install.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages > /dev/null || true
# Bytecode for smoltorrent's own modules now: an editable install leaves it to the first
# import, which writes none where PYTHONDONTWRITEBYTECODE is set, and then every command
# compiles them again (0.1 s of each CLI start). A wheel install compiles them already.
.venv/bin/python -m compileall -q -j 0 smoltorrent coordinator worker_server tasks beat > /dev/null
