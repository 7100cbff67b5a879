"""A send to a peer whose host stopped acknowledging gives up after STALL_S, not the whole
socket timeout, while a peer that is alive but not reading gets the whole timeout. The
sender and the receiver are real processes; the unplugged host is a network namespace
whose switch port goes down (made and removed here; root and iproute2)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from coordinator.local.netns import Lan
from smoltorrent import defaults
from tests.conftest import require_network_namespaces

# Sends up to 200 MB to HOST:PORT with wire.send_all under a socket timeout of TIMEOUT s (or
# a short request and waits for an answer) and prints how it ended; the receiver never
# reads or answers, so the sender always waits at some point.
SENDER = """
import socket, sys, time
from worker_server import wire
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sock = wire.connect(host, port, timeout)
print("connected", flush=True)
sys.stdin.readline()  # the test cuts the link (or not), then lets us send
try:
    if sys.argv[4] == "send":
        wire.send_all(sock, bytes(200_000_000))
    else:  # a short request, then its answer awaited
        sock.sendall(bytes(1000))
        wire.recv_exact(sock, 1)
    print("done")
except TimeoutError as exc:
    print("timeout:", exc)
"""

# Accepts one connection and holds it without reading: alive, with a full window.
RECEIVER = """
import socket, sys, time
srv = socket.create_server((sys.argv[1], 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
time.sleep(600)
"""

LONG_TIMEOUT_S = 120  # the socket timeout: far longer than the test may wait for the stall


def _spawn(prefix: list[str], code: str, *args: str) -> subprocess.Popen[str]:
    argv = [*prefix, sys.executable, "-c", code, *args]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def _send(sender_prefix, receiver_prefix, host, timeout_s, before_send=lambda: None, how="send"):
    receiver = _spawn(receiver_prefix, RECEIVER, host)
    sender = None
    try:
        port = receiver.stdout.readline().strip()
        sender = _spawn(sender_prefix, SENDER, host, port, str(timeout_s), how)
        assert sender.stdout.readline().strip() == "connected"
        before_send()
        started = time.monotonic()
        out, _ = sender.communicate("go\n", timeout=timeout_s + 60)
        return out.strip(), time.monotonic() - started
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize(
    ("how", "ended"),
    [("send", "peer stopped reading for {} s"), ("ask", "timed out")],
)
def test_a_peer_alive_but_not_reading_gets_the_whole_socket_timeout(how, ended):
    """Its host acknowledges everything (window probes included), so however long it keeps
    us waiting, as a node busy with an fsync or a re-hash would, only the timeout ends it."""
    timeout_s = defaults.STALL_S + 3  # past the stall deadline: it must not fire here
    out, _ = _send([], [], "127.0.0.1", timeout_s, how=how)
    assert out == "timeout: " + ended.format(timeout_s)


@pytest.mark.parametrize("how", ["send", "ask"])
def test_a_peer_whose_host_is_unplugged_is_given_up_after_the_stall_deadline(how):
    """Sending into a full buffer, or waiting for the answer to a request the host never
    acknowledged (a handshake, the tail of a body): both end at the stall deadline."""
    require_network_namespaces()
    lan = Lan(["a", "b"], prefix=f"ststall{os.getpid() % 10000}").open()
    try:
        out, waited = _send(
            lan.exec_prefix("a"),
            lan.exec_prefix("b"),
            lan.address("b"),
            LONG_TIMEOUT_S,
            before_send=lambda: lan.cut("b"),
            how=how,
        )
    finally:
        left = lan.close()
    assert out.startswith(f"timeout: peer acknowledged nothing for {defaults.STALL_S:g} s")
    assert waited < LONG_TIMEOUT_S  # the mechanism above, not a speed: the timeout never came
    assert left == []
