"""Chain replication between real node processes: chain_put keeps a blob and passes it on
while it arrives; every node verifies its copy and the report says what became of each."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import KeptConnections, NodeAddress, NodeClient
from smoltorrent.errors import NodeError
from tests.nodeproc import NodeProcess
from tests.tcpproxy import start_proxy
from tests.worker_server.conftest import CLUSTER_KEY, STALL_TIMEOUT_S, SourceBlob
from tests.worker_server.test_disk_full import fill_up
from worker_server import chain, protocol, wire

MIB = 1024 * 1024
READ_TIMEOUT_S = 10.0  # seconds; generous for loopback on a loaded machine


@pytest.fixture
def metered_nodes(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """Nodes that serve /metrics, so a test can read the bytes each one received and sent."""
    started: list[NodeProcess] = []

    def factory(name: str, cluster_key: bytes | None = CLUSTER_KEY) -> NodeProcess:
        env = {**os.environ, "SMOLTORRENT_METRICS_PORT": "0"}
        node = NodeProcess(
            tmp_path / name, cluster_key, socket_timeout=STALL_TIMEOUT_S * 4, env=env
        ).start()
        started.append(node)
        return node

    yield factory
    for node in started:
        node.kill()


def counter(node: NodeProcess, name: str) -> float:
    port = (node.data_dir / "metrics_port").read_text().strip()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    return float(next(x for x in text.splitlines() if x.startswith(name)).split()[-1])


def received(node: NodeProcess) -> float:
    return counter(node, "smoltorrent_node_bytes_received_total")


def sent(node: NodeProcess) -> float:
    return counter(node, "smoltorrent_node_bytes_sent_total")


def blob_bytes(node: NodeProcess, digest: str) -> bytes:
    return (node.data_dir / "blobs" / digest[:2] / digest).read_bytes()


def chain_put(blob: SourceBlob, nodes: list[NodeProcess], **kwargs):
    head, rest = nodes[0], nodes[1:]
    return head.client(timeout=READ_TIMEOUT_S).chain_put(
        blob.digest,
        blob.prefix,
        blob.fd,
        blob.offset,
        blob.length,
        [n.address for n in rest],
        **kwargs,
    )


def statuses(report) -> list[str]:
    return [report.head["status"], *(fate["status"] for _, fate in report.forward)]


@pytest.mark.parametrize("replicas", [2, 3])
def test_chain_store_is_byte_identical_and_the_sender_link_carries_it_once(
    metered_nodes, make_blob, replicas: int
) -> None:
    nodes = [metered_nodes(f"n{i}") for i in range(replicas)]
    blob = make_blob(6 * MIB + 123)
    size = len(blob.content)
    report = chain_put(blob, nodes)
    assert report.sent == size
    assert statuses(report) == ["stored"] * replicas
    ids = [report.head["node_id"], *(fate["node_id"] for _, fate in report.forward)]
    assert ids == [n.client().ping() for n in nodes]
    for node in nodes:
        assert blob_bytes(node, blob.digest) == blob.content
    # Every node received the blob once; all but the tail passed it on once: what the
    # sender's own link carried is the total received minus what nodes sent each other.
    assert [received(n) for n in nodes] == [size] * replicas
    assert [sent(n) for n in nodes] == [size] * (replicas - 1) + [0]
    assert sum(received(n) for n in nodes) - sum(sent(n) for n in nodes) == size


def test_a_head_that_holds_the_blob_passes_its_own_copy_on(node_factory, make_blob) -> None:
    head, tail = node_factory("head"), node_factory("tail")
    blob = make_blob(2 * MIB)
    assert blob.put(head.client()) is True
    report = chain_put(blob, [head, tail])
    assert report.sent == 0  # nothing crossed the sender's link
    assert statuses(report) == ["exists", "stored"]
    assert blob_bytes(tail, blob.digest) == blob.content
    again = chain_put(blob, [head, tail])
    assert statuses(again) == ["exists", "exists"] and again.sent == 0


def test_an_unreachable_next_node_is_skipped_for_the_one_after(node_factory, make_blob) -> None:
    a, b, c = node_factory("a"), node_factory("b"), node_factory("c")
    b.kill()  # nothing listens at b's address any more
    blob = make_blob(MIB)
    report = chain_put(blob, [a, b, c])
    assert statuses(report) == ["stored", "failed", "stored"]
    assert report.forward[0][1]["error"] == "peer_unavailable"
    assert blob_bytes(c, blob.digest) == blob.content


def test_next_node_killed_mid_chain_the_head_pushes_its_copy_past_it(
    node_factory, make_blob
) -> None:
    """SIGKILL of the middle node while the body streams through it: the head keeps its
    own copy, reports the middle node failed and gives its copy to the node after it."""
    a, b, c = node_factory("a"), node_factory("b"), node_factory("c")
    blob = make_blob(8 * MIB)
    size = len(blob.content)
    assert a.address is not None
    with wire.connect(a.address.host, a.address.port, READ_TIMEOUT_S) as sock:
        wire.client_handshake(sock, CLUSTER_KEY, str(a.address))
        request = {
            "op": "chain_put",
            "digest": blob.digest,
            "size": size,
            "forward": [str(b.address), str(c.address)],
        }
        wire.send_frame_header(sock, request, size)
        assert wire.recv_final_response(sock, str(a.address))[0]["status"] == "continue"
        half = size // 2
        sock.sendall(blob.content[:half])
        # The chain is open end to end once both b and c have a temp file for the blob.
        deadline = time.monotonic() + READ_TIMEOUT_S
        while not (list((b.data_dir / "tmp").iterdir()) and list((c.data_dir / "tmp").iterdir())):
            assert time.monotonic() < deadline, "the chain did not reach b and c"
            time.sleep(0.01)
        b.send_signal(signal.SIGKILL)
        sock.sendall(blob.content[half:])
        header, _ = wire.recv_final_response(sock, str(a.address))
        report = protocol.validate_chain_report(header, 2)
    assert [report["self"]["status"]] + [e["status"] for e in report["forward"]] == [
        "stored",
        "failed",
        "stored",
    ]
    assert report["forward"][0]["error"] == "peer_unavailable"
    assert blob_bytes(a, blob.digest) == blob.content
    assert blob_bytes(c, blob.digest) == blob.content


def test_a_corrupt_forward_is_reported_as_the_tail_digest_mismatch(
    node_factory, make_blob, tmp_path: Path
) -> None:
    """The link from the middle node to the tail flips one byte: the tail refuses its copy
    and the report that reaches the sender says so; the other copies are whole."""
    a, b, c = node_factory("a"), node_factory("b"), node_factory("c")
    blob = make_blob(3 * MIB)
    proxy = start_proxy(str(c.address), tmp_path / "proxy", flip_at=2 * MIB)
    try:
        report = a.client(timeout=READ_TIMEOUT_S).chain_put(
            blob.digest,
            blob.prefix,
            blob.fd,
            blob.offset,
            blob.length,
            [b.address, NodeAddress("127.0.0.1", proxy.port)],
        )
    finally:
        proxy.stop()
    assert statuses(report) == ["stored", "stored", "failed"]
    tail = report.forward[1][1]
    assert tail["error"] == "digest_mismatch" and tail["node_id"] == c.client().ping()
    assert c.client().has([blob.digest]) == set()
    assert list((c.data_dir / "tmp").iterdir()) == []
    assert blob_bytes(b, blob.digest) == blob.content


def test_the_forwarding_node_authenticates_like_a_client(node_factory, make_blob) -> None:
    """A next node with another cluster key refuses the forwarding node; the report says
    so and the head's copy stands."""
    a = node_factory("a")
    stranger = node_factory("stranger", cluster_key=b"another-key")
    blob = make_blob(MIB)
    report = chain_put(blob, [a, stranger])
    assert statuses(report) == ["stored", "failed"]
    assert report.forward[0][1]["error"] == "unauthorized"
    assert stranger.client().has([blob.digest]) == set()


def test_chain_put_refuses_bad_forward_lists(node_factory, make_blob) -> None:
    a = node_factory("a")
    blob = make_blob(1024)
    client = a.client()
    too_many = [NodeAddress("127.0.0.1", 1000 + i) for i in range(8)]
    for forward in (too_many, [too_many[0], too_many[0]]):
        with pytest.raises(NodeError) as refused:
            client.chain_put(blob.digest, blob.prefix, blob.fd, blob.offset, blob.length, forward)
        assert refused.value.code == "bad_request"
    # The node is none the worse: a chain of one is a put with a report.
    assert statuses(
        client.chain_put(blob.digest, blob.prefix, blob.fd, blob.offset, blob.length, [])
    ) == ["stored"]


def test_replicate_still_copies_node_to_node(node_factory, make_blob) -> None:
    a, b = node_factory("a"), node_factory("b")
    blob = make_blob(MIB)
    assert blob.put(a.client()) is True
    assert a.client().replicate(blob.digest, b.address) is True
    assert blob_bytes(b, blob.digest) == blob.content


def test_clients_only_need_the_report_of_a_chain_of_one(node_factory, make_blob) -> None:
    a = node_factory("a")
    blob = make_blob(1024)
    report = NodeClient(a.address, cluster_key=CLUSTER_KEY).chain_put(
        blob.digest, blob.prefix, blob.fd, blob.offset, blob.length, []
    )
    assert report.forward == [] and report.head["status"] == "stored"


def test_a_head_whose_disk_fills_mid_chain_still_passes_the_blob_on(
    small_fs: Path, node_factory, make_blob
) -> None:
    """The head's own copy fails for want of space while the body streams through it: it
    reports disk_full for itself and the next node still gets a whole copy."""
    head = NodeProcess(small_fs, CLUSTER_KEY, socket_timeout=STALL_TIMEOUT_S * 4).start()
    try:
        tail = node_factory("tail")
        blob = make_blob(3 * MIB)
        size = len(blob.content)
        assert head.address is not None
        with wire.connect(head.address.host, head.address.port, READ_TIMEOUT_S) as sock:
            wire.client_handshake(sock, CLUSTER_KEY, str(head.address))
            request = {
                "op": "chain_put",
                "digest": blob.digest,
                "size": size,
                "forward": [str(tail.address)],
            }
            wire.send_frame_header(sock, request, size)
            assert wire.recv_final_response(sock, str(head.address))[0]["status"] == "continue"
            fill_up(head.data_dir / "filler")  # someone else takes the space meanwhile
            sock.sendall(blob.content)
            header, _ = wire.recv_final_response(sock, str(head.address))
            report = protocol.validate_chain_report(header, 1)
        assert report["self"]["status"] == "failed" and report["self"]["error"] == "disk_full"
        assert report["forward"][0]["status"] == "stored"
        assert blob_bytes(tail, blob.digest) == blob.content
        assert list((head.data_dir / "tmp").iterdir()) == []
    finally:
        head.kill()


ACCEPTED = "smoltorrent_node_connections_accepted_total"


def chain_puts(head: NodeProcess, blobs: list[SourceBlob], forward: list[NodeAddress]):
    """The blobs' chain_puts in turn over one kept connection to the head, as a chain task
    sends its batch; their reports."""
    with KeptConnections() as kept:
        client = NodeClient(head.address, cluster_key=CLUSTER_KEY, timeout=READ_TIMEOUT_S)
        client = client.keeping(kept)
        return [
            client.chain_put(b.digest, b.prefix, b.fd, b.offset, b.length, forward) for b in blobs
        ]


def test_a_head_keeps_its_link_to_the_next_node_for_the_chain_puts_of_one_connection(
    metered_nodes, make_blob
) -> None:
    """A new link per blob cost the next node a TCP accept, the key handshake and a thread,
    twice per chunk of a store at R=3 (hundreds per gigabyte); the chain_puts that reach a
    head over one connection now share its one link to the next node, and that node's to
    the one after it."""
    a, b, c = (metered_nodes(name) for name in "abc")
    blobs = [make_blob(MIB + i) for i in range(6)]
    before = [counter(n, ACCEPTED) for n in (a, b, c)]
    reports = chain_puts(a, blobs, [b.address, c.address])
    assert [statuses(r) for r in reports] == [["stored"] * 3] * 6
    for node in (a, b, c):
        for blob in blobs:
            assert blob_bytes(node, blob.digest) == blob.content
    assert [counter(n, ACCEPTED) - x for n, x in zip((a, b, c), before, strict=True)] == [1, 1, 1]


def test_a_kept_link_to_a_next_node_that_died_is_reported_then_opened_anew(
    node_factory, make_blob
) -> None:
    """The next node dies between two blobs of one connection: the blob after is reported
    failed for it (the head's own copy stands), and once it is back the next blob reaches
    it over a new link."""
    a, b = node_factory("a"), node_factory("b")
    blobs = [make_blob(MIB), make_blob(MIB), make_blob(MIB)]
    with KeptConnections() as kept:
        client = NodeClient(a.address, cluster_key=CLUSTER_KEY, timeout=READ_TIMEOUT_S)
        client = client.keeping(kept)

        def put(blob: SourceBlob):
            return client.chain_put(
                blob.digest, blob.prefix, blob.fd, blob.offset, blob.length, [b.address]
            )

        assert statuses(put(blobs[0])) == ["stored", "stored"]
        b.kill()
        report = put(blobs[1])
        assert statuses(report) == ["stored", "failed"]
        assert report.forward[0][1]["error"] == "peer_unavailable"
        b.restart()
        assert statuses(put(blobs[2])) == ["stored", "stored"]
    assert blob_bytes(a, blobs[1].digest) == blobs[1].content
    assert b.client().has([x.digest for x in blobs]) == {blobs[0].digest, blobs[2].digest}


def test_a_kept_link_that_corrupts_one_blob_reports_it_and_carries_the_next(
    node_factory, make_blob, tmp_path: Path
) -> None:
    """The link from head to tail flips one byte inside the second of three blobs sent over
    one connection: the tail refuses that copy and says so, and the blobs before and after
    it reach the tail whole."""
    a, b = node_factory("a"), node_factory("b")
    blobs = [make_blob(MIB), make_blob(MIB), make_blob(MIB)]
    # Past the first blob and the second's request header: inside the second body.
    proxy = start_proxy(str(b.address), tmp_path / "proxy", flip_at=MIB + MIB // 2)
    try:
        reports = chain_puts(a, blobs, [NodeAddress("127.0.0.1", proxy.port)])
    finally:
        proxy.stop()
    assert [statuses(r) for r in reports] == [
        ["stored", "stored"],
        ["stored", "failed"],
        ["stored", "stored"],
    ]
    assert reports[1].forward[0][1]["error"] == "digest_mismatch"
    assert b.client().has([x.digest for x in blobs]) == {blobs[0].digest, blobs[2].digest}


def _frames_within(sock, seconds: float) -> list[dict]:
    """Every frame header that arrives on sock within `seconds` (0: those already there)."""
    frames, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 or seconds == 0:
        sock.settimeout(max(left, 0))
        try:
            frame = wire.recv_frame_header(sock)
        except (TimeoutError, BlockingIOError):  # BlockingIOError: nothing there (0)
            break
        assert frame is not None
        frames.append(frame[0])
    return frames


def test_a_sessions_keepalive_sends_progress_only_during_a_chain_put_from_one_thread() -> None:
    """A thread started and joined per chain_put cost a node ~0.25 ms of CPU per blob;
    one thread per session now serves all its chain_puts, and still sends progress frames
    only while one runs (none may follow the report)."""
    ours, sender = socket.socketpair()
    keepalive = chain.Keepalive(ours, interval=0.05)
    try:
        threads = []
        for done in (7, 11):
            with keepalive.running():
                keepalive.progress = done
                frames = _frames_within(sender, 0.3)
                threads.append({t for t in threading.enumerate() if t.name == "chain-keepalive"})
            # A frame sent after the read above gave up but before the block ended is in the
            # socket already (sent under the lock that ending the block takes): not "after".
            frames += _frames_within(sender, 0)
            assert len(frames) >= 2
            assert all(f == {"ok": True, "progress": done} for f in frames)
            assert _frames_within(sender, 0.2) == []  # between chain_puts: silence
        assert threads[0] == threads[1] and len(threads[0]) == 1
    finally:
        keepalive.close()
        ours.close()
        sender.close()
    assert not any(t.name == "chain-keepalive" for t in threading.enumerate())


def _context_switches(thread: threading.Thread) -> int:
    """How many times `thread` has gone to sleep and been woken (Linux /proc)."""
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_back_to_back_chain_puts_do_not_wake_the_keepalive_thread_each_time() -> None:
    """A chain task sends its batch of chunks one chain_put after the other on one
    connection. Waking the session's keepalive thread at each one cost the node two
    context switches per blob copy (~4 of its ~18); a thread still waiting out the last
    put's interval wakes by itself in time for the next one's first frame."""
    ours, sender = socket.socketpair()
    # An interval no slow machine outlasts here: every wake-up counted is a notify, none
    # the thread's own timed wait running out.
    keepalive = chain.Keepalive(ours, interval=60)
    try:
        with keepalive.running():  # starts the thread
            pass
        thread = next(t for t in threading.enumerate() if t.name == "chain-keepalive")
        time.sleep(0.05)  # settled in its wait
        before = _context_switches(thread)
        for done in range(100):
            with keepalive.running():
                keepalive.progress = done
                time.sleep(0.001)  # a put waits on its socket and disk: other threads run
        woken = _context_switches(thread) - before
        assert woken < 10, f"the keepalive thread was woken {woken} times for 100 chain_puts"
    finally:
        keepalive.close()
        ours.close()
        sender.close()


def test_a_put_right_after_another_gets_its_progress_frames() -> None:
    """The thread, still in the timed wait the last chain_put left it in (not woken by
    the next one), sends the next put's frames when its interval is due."""
    ours, sender = socket.socketpair()
    keepalive = chain.Keepalive(ours, interval=0.5)
    try:
        with keepalive.running():
            pass
        with keepalive.running():
            keepalive.progress = 5
            frames = _frames_within(sender, 1.2)
        assert frames and all(f == {"ok": True, "progress": 5} for f in frames)
    finally:
        keepalive.close()
        ours.close()
        sender.close()
