"""A store's spool (SMOLTORRENT_HOME/spool/<vkey>/: the chunks it encoded, waiting to be
sent) goes as soon as nothing will send from it: when the store fails to place its
chunks, and when reconcile aborts its version past PENDING_DEADLINE_S. Both were left
until the worker's next start (beat/boot.py clear_spool), weeks on a worker that stays up,
up to about 0.7x a checkpoint's size of disk each (issue 37 4g)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import torch

from coordinator.state import redis_keys as K
from coordinator.state.versions import ABORTED, PENDING
from smoltorrent import defaults
from tests.nodeproc import start_node
from tests.tasks.conftest import wait_until
from tests.tasks.test_chunked_store import write


def weights(mib: int) -> dict[str, torch.Tensor]:
    """bf16 N(0, 0.02) matrices of 1 MiB each: zstd shrinks them (they are spooled) by
    about a third, no more."""
    generator = torch.Generator().manual_seed(3)
    return {
        f"w{i}": (torch.randn(512, 1024, generator=generator) * 0.02).to(torch.bfloat16)
        for i in range(mib)
    }


def spooled(cluster) -> list[str]:
    root = cluster.root / "spool"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_a_store_that_cannot_place_its_chunks_leaves_no_spool(make_cluster, tmp_path, small_fs):
    c = make_cluster(1, chunks=True, SMOLTORRENT_ENCODE="zstd")
    small = start_node(small_fs)  # a node with 4 MiB of disk, the cluster's only one
    try:
        c.cli("nodes", "rm", str(c.node_procs[0].address))
        c.cli("nodes", "add", str(small.address))
        src = write(tmp_path / "big.safetensors", weights(12))  # ~8 MiB encoded
        stored = c.cli("store", str(src), "--name", "big", check=False)
        assert stored.returncode == 1, stored.stdout + stored.stderr
        assert "room" in stored.stderr or "space" in stored.stderr, stored.stderr
        # Its chunks were encoded into the spool, then placement failed: none is kept.
        assert spooled(c) == []
    finally:
        small.stop()


def test_a_version_aborted_past_its_deadline_has_its_spool_removed(make_cluster, tmp_path):
    c = make_cluster(3, chunks=True, SMOLTORRENT_ENCODE="zstd", SMOLTORRENT_SOCKET_TIMEOUT_S="2")
    # Registered and seen a moment ago, then frozen: the store places on them, records
    # the version pending, and no transfer gets a copy through.
    for node in c.node_procs:
        node.send_signal(signal.SIGSTOP)
    try:
        src = write(tmp_path / "m.safetensors", weights(4))
        c.cli_json("store", str(src), "--name", "m", "--no-wait")
        vkey = wait_until(
            lambda: next((v for v, _ in c.md.listing.versions_in(PENDING)), None),
            what="the version recorded pending",
        )
        assert (c.root / "spool" / vkey).is_dir()
        # Pending since past the deadline (7 days: the record's time set back, not waited).
        created = c.md.sweeps.redis_time() - defaults.PENDING_DEADLINE_S - 60
        c.md.r.hset(K.VERSION.format(vkey=vkey), "created_at", created)
        passed = subprocess.run(
            [
                sys.executable,
                "-c",
                "import json; from beat.reconcile import run_pass; print(json.dumps(run_pass()))",
            ],
            env=c.env(),
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        assert json.loads(passed.stdout.splitlines()[-1])["aborts"] == 1
        assert c.md.versions.state(vkey) == ABORTED
        # The worker that stored it, still running, drops its spool (it was kept until
        # the worker's next start, and then only once SPOOL_ORPHAN_AGE_S old).
        wait_until(lambda: vkey not in spooled(c), timeout=30, what="the spool removed")
    finally:
        for node in c.node_procs:
            node.send_signal(signal.SIGCONT)
