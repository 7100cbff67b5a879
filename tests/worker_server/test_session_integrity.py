"""A man in the middle of a keyed session, as a real process: every change it makes is refused.

The proxy relays the handshake untouched (it cannot take part: it has no key),
then changes, replays or injects frames. The node refuses what reached it
altered and keeps the blob; the client refuses what reached it altered.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from smoltorrent.errors import AuthenticationError
from tests.nodeproc import NodeProcess
from tests.worker_server.conftest import CLUSTER_KEY, SourceBlob

PROXY = Path(__file__).with_name("mitm_proxy.py")
READ_TIMEOUT_S = 5.0  # seconds; the node answers a refused frame at once


@pytest.fixture
def proxy() -> Iterator[Callable[[NodeProcess, str, str], NodeClient]]:
    """proxy(node, mode, digest) -> a client whose connection runs through the attacker."""
    started: list[subprocess.Popen] = []

    def start(node: NodeProcess, mode: str, digest: str) -> NodeClient:
        assert node.address is not None
        process = subprocess.Popen(
            [sys.executable, str(PROXY), str(node.address.port), mode, digest],
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        assert process.stdout is not None
        port = int(process.stdout.readline())
        address = NodeAddress("127.0.0.1", port)
        return NodeClient(address, cluster_key=CLUSTER_KEY, timeout=READ_TIMEOUT_S)

    yield start
    for process in started:
        process.kill()
        process.wait()


@pytest.fixture
def stored(node_factory, make_blob) -> tuple[NodeProcess, SourceBlob]:
    node = node_factory("victim")
    blob = make_blob(4096)
    assert blob.put(node.client())
    return node, blob


def test_operation_flipped_after_the_handshake_is_refused(stored, proxy) -> None:
    node, blob = stored
    client = proxy(node, "flip-op", blob.digest)
    with pytest.raises(AuthenticationError, match="integrity check"):
        client.ping()  # reaches the node as `delete blob`, with the ping's tag
    assert node.client().has([blob.digest]) == {blob.digest}
    assert "failed its integrity check" in node.log()


def test_replayed_frame_is_refused(stored, proxy) -> None:
    node, blob = stored
    client = proxy(node, "replay", blob.digest)
    # The first copy is answered; the node refuses the second, so the stream ends there.
    assert client.delete(blob.digest) is True
    assert "frame 1 of this connection failed its integrity check" in _wait_for_log(node)


def test_altered_answer_is_refused_by_the_client(stored, proxy) -> None:
    node, blob = stored
    client = proxy(node, "flip-answer", blob.digest)
    with pytest.raises(AuthenticationError, match="integrity check"):
        client.has([blob.digest])


def test_relayed_challenge_gives_the_impostor_nothing(stored, proxy) -> None:
    """An impostor at a node's address relays the node's challenge to a real client and
    the client's proof back: the node accepts that handshake, but the proof is bound to
    the nonces and the session keys never leave the two ends, so the impostor can neither
    act on the node nor answer for it."""
    node, blob = stored
    client = proxy(node, "inject", blob.digest)
    with pytest.raises(AuthenticationError, match="integrity check"):
        client.ping()
    assert node.client().has([blob.digest]) == {blob.digest}
    assert "failed its integrity check" in _wait_for_log(node)


def _wait_for_log(node: NodeProcess) -> str:
    deadline = time.monotonic() + READ_TIMEOUT_S
    while "integrity check" not in node.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    return node.log()
