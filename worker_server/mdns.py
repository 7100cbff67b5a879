"""The node's mDNS advert: a small multicast DNS responder, standard library only.

A node answers, on 224.0.0.251:5353, what a browser (the coordinator's zeroconf,
avahi-browse, dns-sd) asks about `_smoltorrent._tcp.local.` (RFC 6762 and 6763, the
subset a single service needs):

  PTR  _smoltorrent._tcp.local.       -> smoltorrent-<id12>._smoltorrent._tcp.local.
  SRV  smoltorrent-<id12>...          -> st-<id12>.local., the node's TCP port
  TXT  smoltorrent-<id12>...          -> id=<node id> proto=<protocol> port=<port> metrics=<port>
  A    st-<id12>.local.               -> the node's address facing whoever asked

and PTR for `_services._dns-sd._udp.local.` (service type enumeration). Answers go to
the multicast group (every browser on the link sees them), or straight back to a
legacy querier that asked from a port other than 5353.

Only queries from the link are answered (RFC 6762 11): one sent to the group (never
routed beyond the link) or one that arrives with IP TTL 255 (a router on the way would
have lowered it). Any other unicast query may come from anywhere, a scan or a reflection
through the node, and is dropped. The kernel tells each packet's destination and TTL
(IP_PKTINFO and IP_RECVTTL on Linux, IP_RECVDSTADDR and IP_RECVTTL on macOS); where it
cannot, nothing is answered to a querier directly: answers go to the group only, which
reaches no one off the link. It announces itself twice at
start (RFC 6762 8.3) and again when its address changes (DHCP), and says goodbye
(TTL 0) at stop, so a browser learns of a move or a departure without polling.

The address in an A record is the one the node's routing table picks towards the
querier (or the group, for announcements), unless the node listens on one address.
A node listening on loopback only advertises nothing: no other machine could reach it.
Anything malformed is dropped; nothing in a packet is ever trusted beyond its bounds.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

from smoltorrent import defaults

log = logging.getLogger("smoltorrent.mdns")

SERVICE = "_smoltorrent._tcp.local."
SERVICE_TYPES = "_services._dns-sd._udp.local."  # RFC 6763 9: which types are on the link

TYPE_A, TYPE_PTR, TYPE_TXT, TYPE_SRV, TYPE_ANY = 1, 12, 16, 33, 255
CLASS_IN = 1
CACHE_FLUSH = 0x8000  # on records only this node owns (RFC 6762 10.2)
UNICAST_RESPONSE = 0x8000  # the QU bit of a question's class
FLAGS_RESPONSE = 0x8400  # QR (a response) + AA (authoritative)
MAX_POINTER_HOPS = 32  # compression pointers followed per name; more means a loop
MAX_PACKET = 9000  # bytes; RFC 6762 17: mDNS messages fit in a jumbo frame


# Ancillary data asking each packet's destination and TTL: (option, cmsg type) per
# platform, from <netinet/in.h>; Python's socket module names none of them on Linux.
if sys.platform.startswith("linux"):
    _DESTINATION = (8, 8)  # IP_PKTINFO: struct in_pktinfo, header destination at bytes 8-12
    _TTL = (12, 2)  # IP_RECVTTL, delivered as IP_TTL: an int
elif sys.platform == "darwin":
    _DESTINATION = (7, 7)  # IP_RECVDSTADDR: a struct in_addr
    _TTL = (24, 24)  # IP_RECVTTL: an unsigned char
else:
    _DESTINATION = _TTL = None
LINK_TTL = 255  # RFC 6762 11: a packet with this TTL was sent from the link itself


@dataclass(frozen=True)
class Advert:
    """What a node says about itself."""

    node_id: str
    port: int
    protocol: int
    metrics_port: int | None = None

    @property
    def instance(self) -> str:
        return f"smoltorrent-{self.node_id[:12]}.{SERVICE}"

    @property
    def host(self) -> str:
        return f"st-{self.node_id[:12]}.local."

    def txt(self) -> dict[str, str]:
        out = {"id": self.node_id, "proto": str(self.protocol), "port": str(self.port)}
        if self.metrics_port is not None:
            out["metrics"] = str(self.metrics_port)
        return out


# --- wire format (RFC 1035 4.1) ------------------------------------------------------


def encode_name(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split("."):
        raw = label.encode("utf-8")
        if not 0 < len(raw) < 64:
            raise ValueError(f"bad DNS label {label!r}")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def read_name(packet: bytes, offset: int) -> tuple[str, int]:
    """The name at offset (following compression pointers) and the offset after it.
    ValueError past MDNS_MAX_NAME_BYTES, however its pointers assemble it, so no packet
    makes us decode more than that per name."""
    labels: list[str] = []
    end = None
    length_so_far = 1  # the root label's zero byte
    for _ in range(MAX_POINTER_HOPS):
        while True:
            if offset >= len(packet):
                raise ValueError("name runs past the packet")
            length = packet[offset]
            if length & 0xC0 == 0xC0:  # a pointer: the rest of the name is elsewhere
                if offset + 1 >= len(packet):
                    raise ValueError("truncated pointer")
                if end is None:
                    end = offset + 2
                offset = ((length & 0x3F) << 8) | packet[offset + 1]
                break
            if length & 0xC0:
                raise ValueError("unknown label type")
            offset += 1
            if length == 0:
                return ".".join(labels) + ".", end if end is not None else offset
            length_so_far += 1 + length
            if length_so_far > defaults.MDNS_MAX_NAME_BYTES:
                raise ValueError(f"a name over {defaults.MDNS_MAX_NAME_BYTES} bytes long")
            labels.append(packet[offset : offset + length].decode("utf-8", "replace"))
            offset += length
    raise ValueError("compression pointer loop")


def parse_query(packet: bytes) -> tuple[int, list[tuple[str, int, bool]]]:
    """A query's id and its questions as (lower-case name, type, wants unicast); ValueError
    for a response or anything malformed."""
    if len(packet) < 12:
        raise ValueError("short packet")
    query_id, flags, qdcount = struct.unpack_from("!HHH", packet)
    if flags & 0x8000:
        raise ValueError("a response, not a query")
    if qdcount > defaults.MDNS_MAX_QUESTIONS:
        raise ValueError(f"{qdcount} questions, over {defaults.MDNS_MAX_QUESTIONS}")
    questions = []
    offset = 12
    for _ in range(qdcount):
        name, offset = read_name(packet, offset)
        if offset + 4 > len(packet):
            raise ValueError("truncated question")
        qtype, qclass = struct.unpack_from("!HH", packet, offset)
        offset += 4
        questions.append((name.lower(), qtype, bool(qclass & UNICAST_RESPONSE)))
    return query_id, questions


def _record(name: str, rtype: int, ttl: int, rdata: bytes, unique: bool) -> bytes:
    rclass = CLASS_IN | (CACHE_FLUSH if unique else 0)
    return encode_name(name) + struct.pack("!HHIH", rtype, rclass, ttl, len(rdata)) + rdata


def _txt_rdata(pairs: dict[str, str]) -> bytes:
    out = b""
    for key, value in pairs.items():
        item = f"{key}={value}".encode()[:255]
        out += bytes([len(item)]) + item
    return out


class Records:
    """The advert's records, built for one address and one TTL scale (0: goodbye)."""

    def __init__(self, advert: Advert, address: str | None, goodbye: bool = False) -> None:
        host_ttl = 0 if goodbye else defaults.MDNS_HOST_TTL_S
        other_ttl = 0 if goodbye else defaults.MDNS_OTHER_TTL_S
        srv = struct.pack("!HHH", 0, 0, advert.port) + encode_name(advert.host)
        self.ptr = _record(SERVICE, TYPE_PTR, other_ttl, encode_name(advert.instance), False)
        self.types = _record(SERVICE_TYPES, TYPE_PTR, other_ttl, encode_name(SERVICE), False)
        self.srv = _record(advert.instance, TYPE_SRV, host_ttl, srv, True)
        self.txt = _record(advert.instance, TYPE_TXT, other_ttl, _txt_rdata(advert.txt()), True)
        self.a = (
            _record(advert.host, TYPE_A, host_ttl, socket.inet_aton(address), True)
            if address
            else None
        )

    def everything(self) -> tuple[list[bytes], list[bytes]]:
        return [r for r in (self.ptr, self.srv, self.txt, self.a) if r], []


def answers_for(
    advert: Advert, questions: list[tuple[str, int, bool]], address: str | None
) -> tuple[list[bytes], list[bytes]]:
    """(answers, additional records) for the questions about this advert; empty if none."""
    r = Records(advert, address)
    answers: list[bytes] = []
    extra: list[bytes] = []
    instance, host = advert.instance.lower(), advert.host.lower()
    for name, qtype, _ in questions:
        if name == SERVICE and qtype in (TYPE_PTR, TYPE_ANY):
            answers.append(r.ptr)
            extra += [r.srv, r.txt, *([r.a] if r.a else [])]
        elif name == SERVICE_TYPES and qtype in (TYPE_PTR, TYPE_ANY):
            answers.append(r.types)
        elif name == instance:
            if qtype in (TYPE_SRV, TYPE_ANY):
                answers.append(r.srv)
                extra += [r.a] if r.a else []
            if qtype in (TYPE_TXT, TYPE_ANY):
                answers.append(r.txt)
        elif name == host and qtype in (TYPE_A, TYPE_ANY) and r.a:
            answers.append(r.a)
    answers = list(dict.fromkeys(answers))
    extra = [x for x in dict.fromkeys(extra) if x not in answers]
    return answers, extra


def response(
    answers: list[bytes], extra: list[bytes], query_id: int = 0, echo: bytes = b"", qd: int = 0
) -> bytes:
    header = struct.pack("!HHHHHH", query_id, FLAGS_RESPONSE, qd, len(answers), 0, len(extra))
    return header + echo + b"".join(answers) + b"".join(extra)


def _question_section(packet: bytes, count: int) -> bytes:
    offset = 12
    for _ in range(count):
        _, offset = read_name(packet, offset)
        offset += 4
    return packet[12:offset]


# --- the responder -----------------------------------------------------------------


def route_address(peer: str) -> str | None:
    """This machine's address on the route towards peer (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((peer, defaults.MDNS_PORT))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address in ("0.0.0.0", "") else address


class Responder:
    """Answers for one advert on a thread of its own until stop()."""

    def __init__(self, advert: Advert, listen_host: str) -> None:
        self.advert = advert
        # A node bound to one address is reachable there only; 0.0.0.0 asks the routes.
        self.fixed = None if listen_host in ("", "0.0.0.0") else listen_host
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._announced: str | None = None
        self._knows_origin = False  # whether the kernel tells each packet's destination, TTL

    def _address(self, peer: str) -> str | None:
        return self.fixed or route_address(peer)

    def start(self) -> Responder:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        # Other responders (avahi, a second node on this machine) share port 5353.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 255)  # RFC 6762 11
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        try:
            sock.bind(("", defaults.MDNS_PORT))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._knows_origin = _ask_origin(sock)
        self._join()
        self._thread = threading.Thread(target=self._run, name="smoltorrent-mdns", daemon=True)
        self._thread.start()
        return self

    def _join(self) -> None:
        """Join the group on every interface (again: one that came up since is joined now)."""
        group = socket.inet_aton(defaults.MDNS_GROUP)
        requests = [group + socket.inet_aton("0.0.0.0")]
        with contextlib.suppress(OSError):
            for index, _name in socket.if_nameindex():
                requests.append(group + socket.inet_aton("0.0.0.0") + struct.pack("@i", index))
        for request in requests:
            # EADDRINUSE: joined already; EINVAL/ENODEV: no multicast there (loopback)
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, request)

    def _send_multicast(self, packet: bytes, local: str | None) -> None:
        if local:
            # Out of the interface that has this address, whatever the default route says.
            with contextlib.suppress(OSError):
                self._sock.setsockopt(
                    socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(local)
                )
        try:
            self._sock.sendto(packet, (defaults.MDNS_GROUP, defaults.MDNS_PORT))
        except OSError as exc:
            log.debug("mDNS send failed: %s", exc)

    def announce(self, goodbye: bool = False) -> None:
        address = self._address(defaults.MDNS_GROUP)
        answers, extra = Records(self.advert, address, goodbye).everything()
        self._send_multicast(response(answers, extra), address)
        self._announced = address

    def _run(self) -> None:
        # Two announcements a second apart (RFC 6762 8.3), then one whenever the address
        # towards the link changes; the group is joined again on each of those checks.
        next_announce = time.monotonic()
        announcements_left = 2
        next_check = time.monotonic() + defaults.MDNS_RECHECK_S
        while not self._stop.is_set():
            now = time.monotonic()
            if announcements_left and now >= next_announce:
                self.announce()
                announcements_left -= 1
                next_announce = now + 1.0
            if now >= next_check:
                next_check = now + defaults.MDNS_RECHECK_S
                self._join()
                if self._address(defaults.MDNS_GROUP) != self._announced:
                    log.info("mDNS: address now %s", self._address(defaults.MDNS_GROUP))
                    announcements_left, next_announce = 2, now
            wait = min(next_check, next_announce if announcements_left else next_check) - now
            try:
                ready, _, _ = select.select([self._sock], [], [], max(0.05, min(wait, 0.5)))
            except (OSError, ValueError):
                return  # closed by stop()
            if not ready:
                continue
            try:
                packet, ancillary, _, (peer, peer_port) = self._sock.recvmsg(
                    MAX_PACKET, ANCILLARY_BYTES
                )
            except OSError:
                if self._stop.is_set():
                    return
                continue
            on_link = _from_link(ancillary) if self._knows_origin else None
            if on_link is False:
                continue  # a unicast query from who knows where: not ours to answer
            try:
                self._answer(packet, peer, peer_port, direct=bool(on_link))
            except (ValueError, struct.error, UnicodeError):
                continue  # not a query we understand: dropped, as RFC 6762 asks

    def _answer(self, packet: bytes, peer: str, peer_port: int, direct: bool) -> None:
        """Answer a query; straight to a legacy querier only when `direct` (it is known to
        be on the link), else to the group."""
        query_id, questions = parse_query(packet)
        if not questions:
            return
        address = self._address(peer)
        answers, extra = answers_for(self.advert, questions, address)
        if not answers:
            return
        if peer_port != defaults.MDNS_PORT and direct:
            # A legacy (one-shot) querier: answer it alone, echoing its id and questions.
            echo = _question_section(packet, len(questions))
            reply = response(answers, extra, query_id, echo, len(questions))
            with contextlib.suppress(OSError):
                self._sock.sendto(reply, (peer, peer_port))
            return
        self._send_multicast(response(answers, extra), address)

    def stop(self) -> None:
        """Say goodbye (browsers drop the node at once) and close."""
        if self._sock is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
        with contextlib.suppress(OSError):
            self.announce(goodbye=True)
        self._sock.close()
        self._sock = None


ANCILLARY_BYTES = 128  # room for both control messages (a few dozen bytes)


def _ask_origin(sock: socket.socket) -> bool:
    """Ask the kernel for each packet's destination and TTL; whether it will tell."""
    if _DESTINATION is None or _TTL is None:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_IP, _DESTINATION[0], 1)
        sock.setsockopt(socket.IPPROTO_IP, _TTL[0], 1)
    except OSError:
        return False
    return True


def _from_link(ancillary: list[tuple[int, int, bytes]]) -> bool | None:
    """Whether a packet surely came from the link: sent to the group, or with TTL 255.
    None if the kernel said neither its destination nor its TTL."""
    destination = ttl = None
    for level, kind, data in ancillary:
        if level != socket.IPPROTO_IP or _DESTINATION is None or _TTL is None:
            continue
        if kind == _DESTINATION[1]:
            raw = data[8:12] if sys.platform.startswith("linux") else data[:4]
            if len(raw) == 4:
                destination = socket.inet_ntoa(raw)
        elif kind == _TTL[1] and data:
            ttl = data[0] if len(data) == 1 else int.from_bytes(data[:4], sys.byteorder)
    if destination is None and ttl is None:
        return None
    return destination == defaults.MDNS_GROUP or ttl == LINK_TTL


def start_advert(advert: Advert, listen_host: str) -> Responder | None:
    """The node's responder, or None (logged) where mDNS cannot or should not run."""
    if listen_host.startswith("127.") or listen_host == "localhost":
        log.info("mDNS advert off: the node listens on loopback only")
        return None
    try:
        responder = Responder(advert, listen_host).start()
    except OSError as exc:
        log.warning(
            "mDNS advert off: cannot listen on UDP %d (%s); register this node by address",
            defaults.MDNS_PORT,
            exc,
        )
        return None
    log.info("mDNS: advertising %s", advert.instance)
    return responder
