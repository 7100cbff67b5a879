"""A version still pending is not gathered, even asked for by its own version id: the
gather's reader mark (coordinator/state/reader_mark.py) is its "is it committed?" check,
whoever runs the gather (the worker, or the CLI's own process)."""

from __future__ import annotations

import os
import signal

from coordinator.state.versions import COMMITTED
from tests import held_cli
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha


def test_a_pending_version_gathered_by_its_id_is_refused_and_leaves_nothing(make_cluster, tmp_path):
    """The store is held just before its commit writes the manifest: every blob is on
    both nodes, so a gather that skipped the check would rebuild the file. Then it is
    let go, commits, and the same command gathers it."""
    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    allowed.mkdir()
    elsewhere.mkdir()
    c = make_cluster(2, worker=False, SMOLTORRENT_GATHER_DIRS=str(allowed))
    src = make_ckpt(tmp_path / "p.safetensors", 1_000_000)
    # Two pool processes: one holds the commit, the other is free to run a gather.
    worker = held_cli.start_worker(
        c.env(), "tasks.commit:write_manifest_durably", c.root / "worker.log"
    )
    try:
        wait_until(c.worker_answers, timeout=120, what="the held worker")
        c.cli("store", str(src), "--no-wait")
        held = wait_until(
            lambda: held_cli.stopped_child(worker.pid), timeout=120, what="the commit held"
        )
        [row] = [r for r in c.cli_json("ls") if r["name"] == "p.safetensors"]
        assert row["state"] == "pending"
        vkey, version = row["vkey"], row["version_id"][:12]

        # Into an allowed directory this host's worker gathers; elsewhere the CLI itself.
        for out in (allowed / "out.safetensors", elsewhere / "out.safetensors"):
            proc = c.cli(
                "gather", "p.safetensors", "--version", version, "-o", str(out), check=False
            )
            assert proc.returncode == 1, (proc.stdout, proc.stderr)
            assert (
                f"p.safetensors version {version} is pending, not committed; only committed"
                " versions are gathered" in proc.stderr
            ), proc.stderr
            assert list(out.parent.iterdir()) == []
        # The first refusal was the worker's, the second the CLI's own.
        assert c.worker_log().count("event=failed task=gather") == 1
        assert c.md.versions.state(vkey) == "pending"

        os.kill(held, signal.SIGCONT)
        wait_until(lambda: c.md.versions.state(vkey) == COMMITTED, timeout=60, what="the commit")
        out = elsewhere / "out.safetensors"
        c.cli("gather", "p.safetensors", "--version", version, "-o", str(out))
        assert sha(out) == sha(src)
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
