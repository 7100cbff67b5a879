"""A store whose commit runs out of retries is not a failure: the reconcile sweep sends the
commit of a complete barrier again on every pass, so the version may still commit. The
CLI says the outcome is unknown (exit 3), never failed (exit 1); the chaos run, seed 11,
saw an exit 1 there and then the commit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from coordinator.state.versions import COMMITTED
from tests.beat.test_reconcile import FAST
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha


def python(c, code: str, *args: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=c.env(),
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    ).stdout


def test_a_store_whose_commit_ran_out_of_retries_exits_3_and_commits_later(make_cluster, tmp_path):
    c = make_cluster(2, **FAST)
    src = make_ckpt(tmp_path / "d.safetensors")
    # Every node refuses manifests (the directory is a plain file): the commit retries,
    # then runs out of retries.
    for node in c.node_procs:
        shutil.rmtree(node.data_dir / "manifests")
        (node.data_dir / "manifests").write_bytes(b"not a directory")
    store = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "store", str(src), "--json"],
        env=c.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # The phase it ended in: every shard landed, the commit is a dead letter, the version
    # is still pending.
    [vkey] = c.md.listing.pending_versions()
    assert c.md.dead_letters.has_dead_letter(f"commit-{vkey}")
    assert c.md.transfers.barrier_complete(vkey)
    # It exited 1, "the commit failed for good".
    assert store.returncode == 3, store.stdout + store.stderr
    [(rid, _)] = [(k, r) for k, r in requests(c) if r["kind"] == "store"]
    assert f"smoltorrent wait {rid}" in json.loads(store.stdout)["error"]

    for node in c.node_procs:
        (node.data_dir / "manifests").unlink()
        (node.data_dir / "manifests").mkdir()
    python(c, "from beat.reconcile import run_pass; run_pass()")
    wait_until(
        lambda: c.md.versions.version(vkey)["state"] == COMMITTED, timeout=60, what="the commit"
    )
    assert c.cli("wait", rid).returncode == 0
    gathered = tmp_path / "out.safetensors"
    c.cli("gather", "d.safetensors", "-o", str(gathered))
    assert sha(gathered) == sha(src)


def requests(c) -> list[tuple[str, dict[str, str]]]:
    keys = c.md.r.keys("smoltorrent:request:*")
    return [(key.rpartition(":")[2], c.md.r.hgetall(key)) for key in keys]
