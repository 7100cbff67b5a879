"""The API runs in a child process with the cluster's environment, as a training script
does: tasks.app reads SMOLTORRENT_REDIS_URL once, at import."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.tasks.conftest import make_cluster  # noqa: F401  (the fixture, shared)

ROOT = Path(__file__).resolve().parents[2]


def run_api(cluster, script: str, *, timeout: float = 240, check: bool = True):
    """Run `script` with the cluster's environment; its last stdout line, parsed as JSON."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=cluster.env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if not check:
        return proc
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
