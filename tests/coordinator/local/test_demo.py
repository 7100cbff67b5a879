"""`smoltorrent demo` end to end, as the README's first command runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_demo_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMOLTORRENT_")}
    env["SMOLTORRENT_HOME"] = str(tmp_path / "home")
    env["TMPDIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "demo", "--size-mb", "16", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["byte_identical"] is True
    assert report["re_replicated"] is True  # beat healed the killed node's shards
    assert report["checkpoint_bytes"] > 16_000_000 * 0.9
    assert report["killed_node"].startswith("127.0.0.1:")
    assert set(report["seconds"]) >= {"store", "gather", "self-heal"}
    # Everything it started is gone: no leftover cluster directory under TMPDIR.
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("smoltorrent-demo-")]
