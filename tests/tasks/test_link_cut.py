"""A node's link cut mid-store, on an emulated LAN of network namespaces (made and
removed here; root and iproute2): a Pi unplugged, so packets vanish and nobody gets a
reset. Redis, the worker, the CLI and four nodes are real processes in their namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from coordinator.local.lan_cluster import LanCluster
from coordinator.local.netns import Lan, unavailable
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.metadata import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import sha

WHY_NOT = unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"network namespaces: {WHY_NOT}")

NODES = ["n1", "n2", "n3", "n4"]
RATE_MBIT = 16  # per port: 8 MB take ~4 s through the coordinator's, long enough to cut into
SIZE = 8_000_000  # bytes: 4 shards of ~2 MB
CUT_AFTER = 128 * 1024  # bytes the node has received when its cable goes: no blob is whole


@pytest.fixture
def lan_cluster(tmp_path):
    lan = Lan(["coord", *NODES], prefix=f"stcut{os.getpid() % 10000}", rate_mbit=RATE_MBIT)
    lan.open()
    cluster = LanCluster(lan, tmp_path, NODES, {"SMOLTORRENT_SOCKET_TIMEOUT_S": "2"})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = lan.close()
    assert left == []  # every process the test started was stopped before the namespaces went


def test_a_node_unplugged_mid_store_is_replaced_and_the_store_ends_at_r(lan_cluster, tmp_path):
    c, lan, cut = lan_cluster, lan_cluster.lan, NODES[-1]
    src = tmp_path / "c.safetensors"
    write_checkpoint(src, SIZE, hidden=128)
    past = time.time() - 60  # settled: the store need not wait for the file to be finished
    os.utime(src, (past, past))
    store = subprocess.Popen(
        c.cli_argv("store", str(src), "--shards", "4", "--json"),
        env=c.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: lan.counters([cut])[cut][1] >= CUT_AFTER or store.poll() is not None,
            timeout=120,
            what=f"{cut} to receive its first bytes",
        )
        assert store.poll() is None, "the store ended before the cable could be pulled"
        lan.cut(cut)
        out, err = store.communicate(timeout=300)
    finally:
        if store.poll() is None:
            store.kill()
            store.wait()
    assert store.returncode == 0, err
    row = json.loads(out)
    assert row["state"] == COMMITTED and row["min_copies"] == 2, row

    status = c.cli_json("status")  # with the node still unplugged
    nodes = {n["address"]: n for n in status["nodes"]}
    assert not nodes[c.node_address(cut)]["up"]
    assert status["under_replicated"] == []  # R live copies of every shard: on the others
    held = [nodes[c.node_address(n)]["blobs"] for n in NODES[:-1]]
    assert sum(held) == 2 * 4, held  # the nodes' own counts: 4 shards x 2 copies
    assert status["dead_letters"] == 0 and c.cli_json("dlq", "ls") == []

    gathered = tmp_path / "out.safetensors"
    c.cli("gather", "c.safetensors", "-o", str(gathered))
    assert sha(gathered) == sha(src)
