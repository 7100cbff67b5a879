"""The node's mDNS responder, message by message: what it answers, and what it drops.
Real browsers against real node processes: tests/coordinator/test_discovery.py."""

from __future__ import annotations

import socket
import struct

import pytest

from smoltorrent import defaults
from worker_server.mdns import (
    SERVICE,
    TYPE_A,
    TYPE_ANY,
    TYPE_PTR,
    TYPE_SRV,
    TYPE_TXT,
    Advert,
    answers_for,
    encode_name,
    parse_query,
    read_name,
    response,
)

ADVERT = Advert("0123456789abcdef" * 2, 7411, 3, 9411)


def query(*questions: tuple[str, int], qu: bool = False) -> bytes:
    body = b"".join(
        encode_name(name) + struct.pack("!HH", qtype, 1 | (0x8000 if qu else 0))
        for name, qtype in questions
    )
    return struct.pack("!HHHHHH", 7, 0, len(questions), 0, 0, 0) + body


def records(packet: bytes) -> list[tuple[str, int, bytes]]:
    """(name, type, rdata) of every answer and additional record of a response."""
    _, flags, qd, an, ns, ar = struct.unpack_from("!HHHHHH", packet)
    assert flags & 0x8000 and qd == 0
    offset, out = 12, []
    for _ in range(an + ns + ar):
        name, offset = read_name(packet, offset)
        rtype, _, _, length = struct.unpack_from("!HHIH", packet, offset)
        offset += 10
        out.append((name, rtype, packet[offset : offset + length]))
        offset += length
    assert offset == len(packet)
    return out


def test_a_browse_gets_ptr_then_srv_txt_and_the_address_facing_the_querier() -> None:
    _, questions = parse_query(query((SERVICE, TYPE_PTR)))
    got = records(response(*answers_for(ADVERT, questions, "10.0.0.5")))
    by_type = {rtype: (name, rdata) for name, rtype, rdata in got}
    assert by_type[TYPE_PTR] == (SERVICE, encode_name(ADVERT.instance))
    name, srv = by_type[TYPE_SRV]
    assert name == ADVERT.instance and struct.unpack_from("!HHH", srv)[2] == 7411
    txt = by_type[TYPE_TXT][1]
    pairs, i = [], 0
    while i < len(txt):
        pairs.append(txt[i + 1 : i + 1 + txt[i]].decode())
        i += 1 + txt[i]
    assert pairs == [f"id={ADVERT.node_id}", "proto=3", "port=7411", "metrics=9411"]
    assert by_type[TYPE_A] == (ADVERT.host, socket.inet_aton("10.0.0.5"))


def test_direct_questions_and_other_services() -> None:
    for question, expected in [
        ((ADVERT.instance.upper(), TYPE_SRV), {TYPE_SRV, TYPE_A}),  # names are case-blind
        ((ADVERT.instance, TYPE_TXT), {TYPE_TXT}),
        ((ADVERT.instance, TYPE_ANY), {TYPE_SRV, TYPE_TXT, TYPE_A}),
        ((ADVERT.host, TYPE_A), {TYPE_A}),
        (("_services._dns-sd._udp.local.", TYPE_PTR), {TYPE_PTR}),
        (("_http._tcp.local.", TYPE_PTR), set()),
    ]:
        _, questions = parse_query(query(question))
        answers, extra = answers_for(ADVERT, questions, "10.0.0.5")
        got = {rtype for _, rtype, _ in records(response(answers, extra))} if answers else set()
        assert got == expected, question


def test_compressed_names_are_followed_and_loops_refused() -> None:
    packet = query((SERVICE, TYPE_PTR))
    # A second question whose name is a pointer to the first one's (offset 12).
    packet = packet[:4] + struct.pack("!H", 2) + packet[6:] + b"\xc0\x0c" + b"\x00\x10\x00\x01"
    assert [q[:2] for q in parse_query(packet)[1]] == [(SERVICE, TYPE_PTR), (SERVICE, TYPE_TXT)]
    looping = struct.pack("!HHHHHH", 0, 0, 1, 0, 0, 0) + b"\xc0\x0c\x00\x01\x00\x01"
    for bad in [looping, b"\x00" * 5, query((SERVICE, TYPE_PTR))[:-3]]:
        with pytest.raises(ValueError):
            parse_query(bad)
    with pytest.raises(ValueError):  # a response is never answered
        parse_query(response([], []))


# --- which queriers the responder answers (issue 22: unicast queries from any source) ----

QUERIER = r"""
import socket, struct, sys
from worker_server.mdns import SERVICE, TYPE_PTR, encode_name
node, group = sys.argv[1], "224.0.0.251"
def ask(query_id, ttl, to):
    body = encode_name(SERVICE) + struct.pack("!HH", TYPE_PTR, 1)
    packet = struct.pack("!HHHHHH", query_id, 0, 1, 0, 0, 0) + body
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TTL, ttl)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
    sock.sendto(packet, (to, 5353))
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 0))  # a port other than 5353: a legacy querier, answered to itself
sock.settimeout(30)
ask(1, 64, node)    # unicast, TTL 64: as if routed from another network
ask(2, 255, node)   # unicast, TTL 255: can only come from this link
ask(3, 64, group)   # to the group: never routed off the link
ask(4, 64, node)
ask(5, 255, node)
got = []
while not {2, 3, 5} <= set(got):
    got.append(struct.unpack_from("!H", sock.recv(9000))[0])
print(" ".join(map(str, got)))
"""


def test_unicast_queries_are_answered_only_from_the_link(tmp_path) -> None:
    """A node answers a query sent to the mDNS group or arriving with IP TTL 255 (RFC 6762
    11: only a sender on the link can deliver that), and drops a unicast query with a
    lower TTL, which may come from anywhere (a scan, or a reflection through the node)."""
    import os
    import subprocess
    import sys
    import time

    from coordinator.local import netns
    from tests.conftest import require_network_namespaces

    require_network_namespaces()
    lan = netns.Lan(["n0"], prefix=f"stm{os.getpid() % 10000}", subnet="10.78.0")
    log = tmp_path / "node.log"
    try:
        lan.open()
        # A route for the group, as a LAN host has through its default route.
        netns.run("ip", "-n", lan.ns("n0"), "route", "add", "default", "dev", "eth0")
        with open(log, "wb") as sink:
            node = subprocess.Popen(
                [*lan.exec_prefix("n0"), sys.executable, "-m", "worker_server"]
                + ["--data-dir", str(tmp_path / "node"), "--host", "0.0.0.0", "--port", "0"],
                env=dict(os.environ, SMOLTORRENT_CLUSTER_KEY="mdns-test-key"),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 60
            while "mDNS: advertising" not in log.read_text():
                assert node.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            out = subprocess.run(
                [*lan.exec_prefix("n0"), sys.executable, "-c", QUERIER, lan.address("n0")],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stderr
            answered = [int(x) for x in out.stdout.split()]
            assert {2, 3, 5} <= set(answered)
            assert 1 not in answered and 4 not in answered, answered
        finally:
            node.terminate()
            node.wait(30)
    finally:
        left = lan.close()
    assert left == []


def test_a_packet_costly_to_parse_is_refused_early() -> None:
    """750 questions pointing at a name of 2,250 one-byte labels cost ~330 ms of CPU a
    packet to parse: a query is refused past MDNS_MAX_QUESTIONS questions, and a name past
    the 255 bytes DNS allows (RFC 1035 2.3.4), however its pointers assemble it."""

    def packet(*questions: bytes) -> bytes:
        head = struct.pack("!HHHHHH", 0, 0, len(questions), 0, 0, 0)
        return head + b"".join(q + struct.pack("!HH", TYPE_PTR, 1) for q in questions)

    huge = b"\x01a" * 2250 + b"\x00"
    for hostile in (packet(huge), packet(huge, *[b"\xc0\x0c"] * 749)):
        with pytest.raises(ValueError, match="bytes|questions"):
            parse_query(hostile)
    # Each part under the limit, the name their pointer makes over it.
    part = b"\x01a" * 100 + b"\x00"  # 201 bytes, at offset 12
    with pytest.raises(ValueError, match="bytes"):
        parse_query(packet(part, b"\x01b" * 100 + b"\xc0\x0c"))
    assert len(parse_query(packet(part))[1]) == 1
    many = [encode_name(SERVICE)] * defaults.MDNS_MAX_QUESTIONS
    assert len(parse_query(packet(*many))[1]) == defaults.MDNS_MAX_QUESTIONS
    with pytest.raises(ValueError, match="questions"):
        parse_query(packet(*many, encode_name(SERVICE)))
