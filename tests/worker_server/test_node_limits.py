"""A node stays usable and small under slow or greedy peers: deadline, per-address cap, budget."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.dataplane.gather_engine import gather_checkpoint
from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.dataplane.store_engine import store_checkpoint
from smoltorrent import defaults
from smoltorrent.errors import FrameTooLargeError, NodeError
from tests.checkpoints import write_llm_like
from tests.nodeproc import NodeProcess, node_metric, start_node
from tests.worker_server.conftest import CLUSTER_KEY
from worker_server import protocol, wire

READ_TIMEOUT_S = 10.0  # seconds; how long a test waits for a condition on a loaded box
MIB = 1024 * 1024


@pytest.fixture
def patient_node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A keyed node with the default 30 s per-read timeout: only the handshake deadline
    can end a peer that keeps trickling bytes."""
    node = start_node(tmp_path / "patient", CLUSTER_KEY)
    yield node
    node.kill()


class SlowPeers:
    """`count` connections from one address that greet and then trickle an auth frame one
    byte at a time, never finishing; dropped ones are opened again, until stopped."""

    def __init__(self, address: NodeAddress, count: int, source: str) -> None:
        self.address, self.count, self.source = address, count, source
        self.open: dict[socket.socket, int] = {}  # socket -> bytes of the frame sent so far
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlowPeers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(READ_TIMEOUT_S)
        for sock in self.open:
            sock.close()

    def _run(self) -> None:
        frame = protocol.encode_frame({"op": "auth", "mac": "0" * 64, "nonce": "0" * 64})
        while not self._stop.is_set():
            while len(self.open) < self.count:
                sock = socket.create_connection(
                    (self.address.host, self.address.port), source_address=(self.source, 0)
                )
                sock.setblocking(False)
                self.open[sock] = 0
            for sock in list(self.open):
                try:
                    with contextlib.suppress(BlockingIOError):
                        if sock.recv(65536) == b"":
                            raise ConnectionError
                    sent = self.open[sock]
                    # One more byte of a frame whose last byte never comes.
                    self.open[sock] = sent + sock.send(frame[sent : min(sent + 1, len(frame) - 1)])
                except OSError:
                    self.refused += 1
                    del self.open[sock]
                    sock.close()
            self._stop.wait(0.2)


def test_300_slow_connections_do_not_stop_a_store_and_gather(
    patient_node: NodeProcess, tmp_path: Path
) -> None:
    assert patient_node.address is not None
    src = tmp_path / "ckpt.safetensors"
    write_llm_like(src, layers=4, hidden=64)
    out = tmp_path / "restored.safetensors"
    with SlowPeers(patient_node.address, 300, "127.0.0.2") as slow:
        _wait(lambda: slow.refused >= 300 - defaults.MAX_CONNECTIONS_PER_ADDRESS)
        result = store_checkpoint(src, [patient_node.address], replicas=1, cluster_key=CLUSTER_KEY)
        clients = [[patient_node.client()] for _ in result.manifest.entries]
        gather_checkpoint(result.manifest, clients, out)
        assert len(slow.open) > 0  # the attack was still on while we stored and gathered
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(src.read_bytes()).digest()
    assert "connections from that address are open" in patient_node.log()


def test_trickled_handshake_is_cut_at_the_deadline(patient_node: NodeProcess) -> None:
    assert patient_node.address is not None
    with SlowPeers(patient_node.address, 1, "127.0.0.3") as slow:
        # A byte every 0.2 s never lets the 30 s per-read timeout fire: only the deadline can.
        _wait(lambda: slow.refused >= 1, timeout=defaults.SOCKET_TIMEOUT_S)
    assert "no handshake within the 5 s deadline" in patient_node.log()


def test_json_bodies_share_one_memory_budget(tmp_path: Path) -> None:
    """Keyless, as the issue found it: 48 connections each declare a 16 MiB manifest and
    send one byte. The node holds at most its budget and answers the rest `busy`."""
    node = start_node(tmp_path / "keyless")
    assert node.address is not None
    try:
        peak_before = _peak_rss(node.pid)
        greedy = []
        for _ in range(48):
            sock = wire.connect(node.address.host, node.address.port, READ_TIMEOUT_S)
            wire.client_handshake(sock, None, str(node.address))
            head = protocol.encode_frame(
                {"op": "manifest_put", "key": "k"}, defaults.MAX_JSON_BODY_BYTES
            )
            sock.sendall(head + b"{")
            greedy.append(sock)
        busy = 0
        for sock in greedy:
            sock.settimeout(0.5)
            with contextlib.suppress(TimeoutError):  # the ones holding budget stay silent
                header, _ = wire.recv_frame_header(sock)
                assert header["error"] == "busy", header
                busy += 1
        held = defaults.JSON_BODY_BUDGET_BYTES // defaults.MAX_JSON_BODY_BYTES
        assert busy == 48 - held
        growth = _peak_rss(node.pid) - peak_before
        assert growth < 2 * defaults.JSON_BODY_BUDGET_BYTES, f"{growth / MIB:.0f} MiB"
        assert "budget" in node.log()
        for sock in greedy:
            sock.close()
        client = node.client()
        _wait(lambda: _manifest_put_succeeds(client))
    finally:
        node.kill()


def test_has_is_capped_small_and_the_client_batches(keyed_node: NodeProcess) -> None:
    client = keyed_node.client()
    many = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(3 * 512 + 7)]
    assert client.has(many) == set()
    with pytest.raises(FrameTooLargeError, match="has"):
        protocol.validate_request({"op": "has"}, defaults.MAX_HAS_BODY_BYTES + 1)


def _manifest_put_succeeds(client: NodeClient) -> bool:
    try:
        client.put_manifest("after-the-flood", b"{}")
    except NodeError:
        return False
    return True


def _peak_rss(pid: int) -> int:
    """VmHWM: the most resident memory the process has had, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def _wait(condition: Callable[[], bool], timeout: float = READ_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_trickled_json_body_is_cut_and_frees_the_budget(tmp_path: Path) -> None:
    """A peer that sends its manifest one byte at a time (each read beating the 30 s socket
    timeout) is dropped at the body's deadline, and its share of the budget comes back."""
    node = start_node(tmp_path / "keyless")
    assert node.address is not None
    try:
        sock = wire.connect(node.address.host, node.address.port, READ_TIMEOUT_S)
        wire.client_handshake(sock, None, str(node.address))
        size = 1024  # small, so its deadline is about the base
        sock.sendall(protocol.encode_frame({"op": "manifest_put", "key": "slow"}, size))
        deadline = time.monotonic() + defaults.SOCKET_TIMEOUT_S
        sock.settimeout(0.2)
        closed = False
        while not closed:
            assert time.monotonic() < deadline, "the trickled body was never cut"
            try:
                sock.sendall(b" ")
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
        sock.close()
        assert "body did not arrive within" in node.log()
        node.client().put_manifest("after", b"{}")
    finally:
        node.kill()


def _vm_size_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(x for x in status if x.startswith("VmSize:"))
    return int(line.split()[1]) * 1024


@pytest.mark.parametrize("starved", ["thread", "file"])
def test_a_node_out_of_threads_or_descriptors_refuses_and_serves_on(
    tmp_path: Path, starved: str
) -> None:
    """A connection the node cannot give a thread (no address space for its stack) or
    cannot even accept (no file descriptor left) is turned away; the node itself goes on,
    and serves again once the resource is back. Both ended the whole node before: the
    accept loop let RuntimeError and EMFILE out."""
    node = start_node(tmp_path / "starved", CLUSTER_KEY)
    assert node.address is not None
    limit = resource.RLIMIT_AS if starved == "thread" else resource.RLIMIT_NOFILE
    soft, hard = resource.prlimit(node.pid, limit)
    try:
        if starved == "thread":  # a new thread's stack cannot be mapped
            resource.prlimit(node.pid, limit, (_vm_size_bytes(node.pid) + 2 * MIB, hard))
        else:  # every descriptor above those already open is refused
            resource.prlimit(node.pid, limit, (len(os.listdir(f"/proc/{node.pid}/fd")), hard))
        for _ in range(3):
            with contextlib.suppress(OSError):
                sock = socket.create_connection((node.address.host, node.address.port), 5)
                sock.settimeout(1)  # a peer the node cannot accept waits in the backlog
                with contextlib.suppress(OSError):
                    sock.recv(4096)  # a busy frame, or the close
                sock.close()
        time.sleep(0.5)
        assert node.is_running(), node.log_path.read_text()[-2000:]
        resource.prlimit(node.pid, limit, (soft, hard))
        deadline = time.monotonic() + READ_TIMEOUT_S
        while True:
            try:
                assert node.client().ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        node.kill()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(x for x in status if x.startswith("Threads:")).split()[1])


def test_silent_metrics_clients_are_capped_and_timed_out(tmp_path: Path) -> None:
    """/metrics gives each request METRICS_REQUEST_TIMEOUT_S and serves at most
    METRICS_MAX_CONNECTIONS at once: 30 clients that connect and say nothing neither
    cost the node 30 threads nor stay for good, and a scrape works once they are gone."""
    env = dict(os.environ, SMOLTORRENT_METRICS_PORT="0")
    node = NodeProcess(tmp_path / "scraped", CLUSTER_KEY, env=env).start()
    try:
        port = int((node.data_dir / "metrics_port").read_text())
        before = _threads(node.pid)
        silent = [socket.create_connection(("127.0.0.1", port), 5) for _ in range(30)]
        time.sleep(1)
        assert _threads(node.pid) <= before + defaults.METRICS_MAX_CONNECTIONS
        deadline = time.monotonic() + defaults.METRICS_REQUEST_TIMEOUT_S + READ_TIMEOUT_S
        for sock in silent:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(4096) is not None  # b"" (closed) or a refusal, not a hang
            sock.close()
        assert node_metric(node, "smoltorrent_node_info") == 1
    finally:
        node.kill()
