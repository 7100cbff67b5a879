#!/usr/bin/env bash
# Create .venv beside this checkout and install smoltorrent into it.
# Usage: scripts/bootstrap.sh [extra]   (extra: "test" adds the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "smoltorrent needs Python 3.11 or newer ($python is older or missing)." >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
spec="."
[ -n "${1:-}" ] && spec=".[$1]"
.venv/bin/python -m pip install --quiet -e "$spec"
