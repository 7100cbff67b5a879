"""How big each sendfile of a paced send is: a bandwidth limit needs short slices so its
bucket keeps bursts short; a meter that only counts (no limit) must not cut the send
into them (four times the sendfile calls and meter updates for nothing)."""

from __future__ import annotations

import os
import socket
import threading

from smoltorrent import defaults
from worker_server import wire

BODY = 16 * 1024 * 1024


def _sent_in(tmp_path, **slices) -> list[int]:
    """The n of every pace(n) while BODY bytes of a file go over a loopback TCP connection
    (its buffers grow to megabytes, so a sendfile with no slice moves more than one)."""
    path = tmp_path / "body"
    path.write_bytes(os.urandom(BODY))
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    sender.settimeout(10)
    received = bytearray()

    def drain() -> None:
        while len(received) < BODY:
            received.extend(receiver.recv(1 << 20))

    reader = threading.Thread(target=drain)
    reader.start()
    paced: list[int] = []
    with sender, receiver, open(path, "rb") as f:
        wire.send_file_range(sender, f.fileno(), 0, BODY, pace=paced.append, **slices)
        reader.join(10)
    assert bytes(received) == path.read_bytes()
    return paced


def test_a_limited_send_goes_in_short_slices(tmp_path):
    paced = _sent_in(tmp_path)
    assert max(paced) <= defaults.BWLIMIT_SLICE_BYTES and sum(paced) == BODY


def test_a_send_with_no_limit_is_not_cut_into_slices(tmp_path):
    paced = _sent_in(tmp_path, slice_bytes=None)
    assert max(paced) > defaults.BWLIMIT_SLICE_BYTES and sum(paced) == BODY
