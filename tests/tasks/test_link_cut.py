"""A node's link cut mid-store, on an emulated LAN of network namespaces (made and
removed here; root and iproute2): a Pi unplugged, so packets vanish and nobody gets a
reset. Redis, the worker, the CLI and four nodes are real processes in their namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.local.lan_cluster import LanCluster
from coordinator.local.netns import Lan
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.versions import COMMITTED
from tests.conftest import require_network_namespaces
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import sha

NODES = ["n1", "n2", "n3", "n4"]
RATE_MBIT = 16  # per port: 8 MB take ~4 s through the coordinator's, long enough to cut into
SIZE = 8_000_000  # bytes: 4 shards of ~2 MB
CUT_AFTER = 128 * 1024  # bytes the node has received when its cable goes: no blob is whole
# seconds; a socket timeout the store must not wait out, so only the stall deadline
# (defaults.STALL_S) can have ended the wait on the unplugged node
LONG_SOCKET_TIMEOUT_S = 120


@pytest.fixture
def lan_cluster(request, tmp_path):
    require_network_namespaces()
    socket_timeout = getattr(request, "param", 2)  # seconds
    lan = Lan(["coord", *NODES], prefix=f"stcut{os.getpid() % 10000}", rate_mbit=RATE_MBIT)
    lan.open()
    env = {"SMOLTORRENT_SOCKET_TIMEOUT_S": str(socket_timeout)}
    cluster = LanCluster(lan, tmp_path, NODES, env)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        left = lan.close()
    assert left == []  # every process the test started was stopped before the namespaces went


def store_and_unplug(c: LanCluster, tmp_path, cut: str, timeout: float) -> tuple[dict, Path]:
    """Stores a checkpoint and pulls `cut`'s cable once it has received its first bytes;
    the store's JSON row (it must succeed within `timeout` s) and the source file."""
    lan = c.lan
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
        out, err = store.communicate(timeout=timeout)
    finally:
        if store.poll() is None:
            store.kill()
            store.wait()
    assert store.returncode == 0, err
    return json.loads(out), src


def test_a_node_unplugged_mid_store_is_replaced_and_the_store_ends_at_r(lan_cluster, tmp_path):
    c, cut = lan_cluster, NODES[-1]
    row, src = store_and_unplug(c, tmp_path, cut, timeout=300)
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


@pytest.mark.parametrize("lan_cluster", [LONG_SOCKET_TIMEOUT_S], indirect=True)
def test_an_unplugged_node_is_given_up_at_the_stall_deadline_not_the_socket_timeout(
    lan_cluster, tmp_path
):
    """With a socket timeout far too long to wait out, the unplugged node's replicas still
    move to the others: what gave it up was the stall deadline (no ACK from its host for
    STALL_S), as its failed attempts say; the store ends at R=2 without it."""
    c, cut = lan_cluster, NODES[-1]
    # the guard: a store that waited out the socket timeout on the unplugged node fails here
    row, _ = store_and_unplug(c, tmp_path, cut, timeout=LONG_SOCKET_TIMEOUT_S - 10)
    assert row["state"] == COMMITTED and row["min_copies"] == 2, row
    assert row["under_replicated"] == []
    nodes = {n["address"]: n for n in c.cli_json("status")["nodes"]}
    cut_node = nodes[c.node_address(cut)]
    assert not cut_node["up"]
    assert sum(nodes[c.node_address(n)]["blobs"] for n in NODES[:-1]) == 2 * 4
    attempts = recorded_attempts(c, row["vkey"])
    on_cut = [a for a in attempts if a.get("node") == cut_node["node_id"]]
    assert on_cut and all("error" in a for a in on_cut), attempts  # tried, then replaced
    # The stall deadline gave it up; a connection opened to it after the cut may instead
    # end at the connect timeout (seconds). Nothing waited out the socket timeout: the
    # store's own deadline above is shorter.
    errors = [a["error"] for a in on_cut]
    assert any("acknowledged nothing" in e for e in errors), errors


def recorded_attempts(c: LanCluster, vkey: str) -> list[dict]:
    """The version's attempt log, read from Redis inside the coordinator's namespace."""
    code = (
        "import json, os, sys, redis\n"
        "from coordinator.state import redis_keys as K\n"
        "r = redis.Redis.from_url(os.environ['SMOLTORRENT_REDIS_URL'])\n"
        "key = K.ATTEMPTS.format(vkey=sys.argv[1])\n"
        "print(json.dumps([json.loads(x) for x in r.lrange(key, 0, -1)]))\n"
    )
    argv = [*c.lan.exec_prefix(c.coordinator), sys.executable, "-c", code, vkey]
    return json.loads(
        subprocess.run(argv, env=c.env, capture_output=True, text=True, check=True).stdout
    )
