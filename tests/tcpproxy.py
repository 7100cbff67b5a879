"""A real TCP proxy process for fault tests: it can flip a byte or throttle a link.

python -m tests.tcpproxy --target HOST:PORT --port-file FILE [--flip-at N] [--rate BPS]
                        [--reply-rate BPS]

Every connection is forwarded to the target. With --flip-at, the byte at offset
N of what the client sends on that connection is inverted (a node with bad RAM
or a bad link, for every put larger than N). With --rate, what the client sends
is forwarded at about BPS bytes per second (a slow network); with --reply-rate, what
the target answers is (a slow download: a gather). The bound port is
written to FILE once listening. start_proxy() runs it as a child process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

CHUNK = 64 * 1024  # bytes forwarded per read


def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None, rate: float | None):
    seen = 0
    started = time.monotonic()
    try:
        while data := src.recv(CHUNK if rate is None else min(CHUNK, max(1, int(rate / 20)))):
            if flip_at is not None and seen <= flip_at < seen + len(data):
                buf = bytearray(data)
                buf[flip_at - seen] ^= 0xFF
                data = bytes(buf)
            seen += len(data)
            if rate is not None:
                time.sleep(max(0.0, started + seen / rate - time.monotonic()))
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def serve(
    target: tuple[str, int],
    port_file: Path,
    flip_at: int | None,
    rate: float | None,
    reply_rate: float | None = None,
):
    listener = socket.create_server(("127.0.0.1", 0))
    partial = port_file.with_suffix(".partial")
    partial.write_text(str(listener.getsockname()[1]))
    partial.rename(port_file)  # whoever waits for the file never reads half a number
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection(target)
        except OSError:
            client.close()
            continue
        for args in ((client, upstream, flip_at, rate), (upstream, client, None, reply_rate)):
            threading.Thread(target=_pipe, args=args, daemon=True).start()


class Proxy:
    """A running proxy child process; stop() ends it."""

    def __init__(self, process: subprocess.Popen, port: int) -> None:
        self.process = process
        self.port = port

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


def start_proxy(
    target: str,
    workdir: Path,
    *,
    flip_at: int | None = None,
    rate: float | None = None,
    reply_rate: float | None = None,
) -> Proxy:
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / f"proxy-{time.monotonic_ns()}.port"
    command = [sys.executable, "-m", "tests.tcpproxy", "--target", target]
    command += ["--port-file", str(port_file)]
    if flip_at is not None:
        command += ["--flip-at", str(flip_at)]
    if rate is not None:
        command += ["--rate", str(rate)]
    if reply_rate is not None:
        command += ["--reply-rate", str(reply_rate)]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.Popen(command, env=env, cwd=root)
    deadline = time.monotonic() + 15
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("the test proxy did not start")
        time.sleep(0.02)
    return Proxy(process, int(port_file.read_text()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--port-file", required=True, type=Path)
    parser.add_argument("--flip-at", type=int)
    parser.add_argument("--rate", type=float)
    parser.add_argument("--reply-rate", type=float)
    args = parser.parse_args()
    host, port = args.target.rsplit(":", 1)
    serve((host, int(port)), args.port_file, args.flip_at, args.rate, args.reply_rate)


if __name__ == "__main__":
    main()
