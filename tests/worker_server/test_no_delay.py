"""Every session socket sends each write at once (TCP_NODELAY), the node's accepted ones
too. A node answers a get with a small frame header, then the blob by sendfile: with
Nagle's algorithm on, the body's last short segment waited for the ACK of what went
before, which a client reading a request-and-answer connection delays by up to ~40 ms,
once per blob (an 8 KiB chunk took 44 ms per get on a kept connection)."""

from __future__ import annotations

import socket

from worker_server import wire


def _nodelay(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


def test_an_accepted_connection_becomes_a_session_without_nagle() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    with server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        assert not _nodelay(accepted)  # what the node's listener hands a session
        with wire.session_socket(accepted) as session:
            assert _nodelay(session)
            session.sendall(b"x")
            assert client.recv(1) == b"x"


def test_a_client_connection_has_no_nagle() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    with server, wire.connect(*server.getsockname(), timeout=5) as client:
        assert _nodelay(client)


def test_a_socket_pair_becomes_a_session_all_the_same() -> None:
    # Not TCP: there is no Nagle to turn off, and wrapping must not fail.
    left, right = socket.socketpair()
    with wire.session_socket(left) as session, right:
        session.sendall(b"y")
        assert right.recv(1) == b"y"
