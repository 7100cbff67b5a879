"""Two ranks on two hosts save one step into one cluster: host A (this test's own network
namespace) runs Redis, two storage nodes, a worker and rank 0; host B (a namespace of
its own, its own home and host id) runs rank 1 and no worker, so rank 1 stores its parts
in its own processes (tasks/requests.py: a store recorded for its caller to run).

The ranks are two plain processes joined by init_process_group over TCP (gloo, the
rendezvous on host A's address), not torchrun: torchrun --nnodes 2 would start an agent
on each host beside its rank, two more imports of torch, for nothing this test checks.
They train the FSDP2 test model one step and save it once through DCP (smoltorrent.dcp,
in the rank's process) and once through save_sharded (through the rank's writer
process); each then loads its part back from the cluster, and rank 0 the DCP step into a
plain model with no group, compared bit for bit with DCP's own FileSystemWriter files.
Host B reaches Redis through a forwarder on host A's address (the embedded Redis listens
on loopback only) and the nodes over the bridge, as another machine on the LAN would.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local import netns
from coordinator.state.embedded_redis import password
from coordinator.state.requests import IN_PROCESS_STORE
from coordinator.state.steps import Steps
from smoltorrent.dcp.steps import split
from tests.conftest import require_network_namespaces
from tests.smoltorrent.conftest import ROOT
from tests.smoltorrent.two_hosts_run import DCP_NAME, SHARDED_NAME, STEP
from tests.tasks.conftest import Cluster, wait_until
from tests.tcpproxy import _pipe

RANK_TIMEOUT_S = 240  # both ranks, beside a loaded CI run
WRITER_EXIT_S = 30  # a writer ends within a poll of its trainer's end; a loaded box


@pytest.fixture
def lan() -> Iterator[netns.Lan]:
    require_network_namespaces()  # fails instead of skipping where CI requires namespaces
    with netns.subnet_lock():
        subnet = netns.free_subnet()
        prefix = f"sth{os.getpid() % 10000}"
        lan = netns.Lan(["a", "b"], prefix=prefix, subnet=subnet, local_host="a")
        lan.open()
    try:
        yield lan
    finally:
        left = lan.close()
    assert left == [], f"processes left in host B: {left}"


@contextlib.contextmanager
def forwarder(address: str, target_port: int) -> Iterator[int]:
    """Connections to address:PORT (the port yielded) forwarded to 127.0.0.1:target_port,
    in threads of this process: Redis for the other host."""
    listener = socket.create_server((address, 0))
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", target_port))
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=_pipe, args=(src, dst, None, None), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def test_ranks_on_two_hosts_one_without_a_worker_save_one_step(lan: netns.Lan, tmp_path: Path):
    a = lan.address("a")
    cluster = Cluster(
        tmp_path / "a",
        nodes=2,
        host_id="a",
        cluster_key=secrets.token_hex(32),  # nodes beyond loopback serve only with a key
        worker_concurrency=2,
        node_places=((a, ()), (a, ())),  # on host A's LAN address: B reaches them too
    )
    try:
        cluster.start()
        cluster.register_nodes()
        with forwarder(a, cluster.redis_port) as redis_port:
            secret = password(cluster.root / "redis")
            host_b = {
                "SMOLTORRENT_REDIS_URL": f"redis://:{secret}@{a}:{redis_port}/0",
                "SMOLTORRENT_HOST_ID": "b",
                "SMOLTORRENT_HOME": str(tmp_path / "b"),
                "GLOO_SOCKET_IFNAME": lan.device("b"),
            }
            port = free_port(a)
            ranks = [
                subprocess.Popen(
                    [
                        *lan.exec_prefix(host),
                        sys.executable,
                        "-m",
                        "tests.smoltorrent.two_hosts_run",
                        str(rank),
                        a,
                        str(port),
                        str(tmp_path),
                    ],  # fmt: skip
                    env={
                        **cluster.env(),
                        "OMP_NUM_THREADS": "1",
                        "GLOO_SOCKET_IFNAME": lan.device("a"),
                        **(host_b if host == "b" else {}),
                    },
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for rank, host in enumerate(["a", "b"])
            ]
            outs = []
            try:
                for proc in ranks:
                    outs.append(proc.communicate(timeout=RANK_TIMEOUT_S)[0])
            finally:
                for proc in ranks:
                    if proc.poll() is None:
                        proc.kill()
                        proc.communicate()
        for proc, out in zip(ranks, outs, strict=True):
            assert proc.returncode == 0, f"rank exited {proc.returncode}:\n{out}"
        # Rank 1's writer process (its own session) ends once its rank has: host B empties.
        wait_until(
            lambda: not netns.run("ip", "netns", "pids", lan.ns("b")).stdout.split(),
            timeout=WRITER_EXIT_S,
            interval=0.2,
            what="host B's processes to end",
        )
        reports = [json.loads(out.strip().splitlines()[-1]) for out in outs]
        assert [r["sharded_same"] for r in reports] == [True, True], reports
        assert reports[0]["dcp_differ"] == [] and reports[0]["dcp_tensors"] == 16, reports[0]

        # Who stored what: host A's parts went to its worker, host B's were run by B itself.
        md = cluster.md
        for run, step in ((SHARDED_NAME, STEP), split(DCP_NAME)):
            found = Steps(md.r).get(run, step)
            assert found is not None and found.state == "committed", (run, found)
            for rank, part in sorted(found.parts.items()):
                version = md.versions.version(part.vkey)
                kind = md.requests.request(version["request_id"])["kind"]
                assert (version["host"], kind) == (
                    ("a", "store") if rank == 0 else ("b", IN_PROCESS_STORE)
                ), (run, rank)
    finally:
        cluster.kill_worker()
        cluster.stop()
