"""A man in the middle between a client and a keyed node, run as its own process.

python tests/worker_server/mitm_proxy.py TARGET_PORT MODE DIGEST

It prints the port it listens on, serves one connection, relays the handshake
untouched, and then attacks the session:

flip-op       rewrites the client's first request into `delete DIGEST`, keeping its tag
replay        sends the client's first request to the node twice
flip-answer   flips one byte of the node's first answer body
inject        an impostor that relayed the node's challenge and the client's proof: it
              sends its own `delete DIGEST` to the node and forges an answer to the client

Standard library only, and no smoltorrent imports: it sees the bytes an attacker sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import sys
import threading

PREFIX = struct.Struct(">4sBBHIQ")  # magic, version, flags, reserved, header_len, body_len
TAG_BYTES = 32
FLAG_BODY_TAG = 0x01


def recv_exact(sock: socket.socket, length: int) -> bytes:
    data = b""
    while len(data) < length:
        chunk = sock.recv(length - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


def read_frame(sock: socket.socket, tagged: bool) -> tuple[tuple, bytes, bytes, bytes]:
    """(prefix fields, header bytes, header tag, body with its tag); bodies here are small."""
    fields = PREFIX.unpack(recv_exact(sock, PREFIX.size))
    header = recv_exact(sock, fields[4])
    tag = recv_exact(sock, TAG_BYTES) if tagged else b""
    body_len = fields[5] + (TAG_BYTES if fields[2] & FLAG_BODY_TAG else 0)
    return fields, header, tag, recv_exact(sock, body_len) if body_len else b""


def pack(fields: tuple, header: bytes, tag: bytes, body: bytes) -> bytes:
    magic, version, flags, reserved, _, body_len = fields
    return PREFIX.pack(magic, version, flags, reserved, len(header), body_len) + header + tag + body


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def attack(client: socket.socket, node: socket.socket, mode: str, digest: str) -> None:
    hello_fields, hello = read_frame_and_forward(node, client)
    node_id, version = json.loads(hello)["node_id"], hello_fields[1]
    read_frame_and_forward(client, node)  # the client's proof
    read_frame_and_forward(node, client)  # the node's proof: the session is keyed from here on
    delete = json.dumps({"op": "delete", "digest": digest}, separators=(",", ":")).encode()
    if mode == "flip-op":
        fields, _, tag, body = read_frame(client, tagged=True)
        node.sendall(pack(fields, delete, tag, body))
    elif mode == "replay":
        frame = pack(*read_frame(client, tagged=True))
        node.sendall(frame + frame)
    elif mode == "flip-answer":
        threading.Thread(target=pipe, args=(client, node), daemon=True).start()
        fields, header, tag, body = read_frame(node, tagged=True)
        body = bytes([body[0] ^ 0x01]) + body[1:]
        client.sendall(pack(fields, header, tag, body))
    elif mode == "inject":
        read_frame(client, tagged=True)  # whatever the client asked is dropped
        fields = (b"SMTR", version, 0, 0, 0, 0)
        node.sendall(pack(fields, delete, os.urandom(TAG_BYTES), b""))
        forged = json.dumps({"ok": True, "node_id": node_id}).encode()
        client.sendall(pack(fields, forged, os.urandom(TAG_BYTES), b""))
    else:
        raise SystemExit(f"unknown mode {mode}")
    threading.Thread(target=pipe, args=(node, client), daemon=True).start()
    pipe(client, node)


def read_frame_and_forward(source: socket.socket, sink: socket.socket) -> tuple[tuple, bytes]:
    fields, header, tag, body = read_frame(source, tagged=False)
    sink.sendall(pack(fields, header, tag, body))
    return fields, header


def main() -> None:
    target_port, mode, digest = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        client, _ = listener.accept()
        node = socket.create_connection(("127.0.0.1", target_port))
        with client, node, contextlib.suppress(ConnectionError, OSError):
            attack(client, node, mode, digest)


if __name__ == "__main__":
    main()
