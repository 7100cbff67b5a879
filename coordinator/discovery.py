"""Finding nodes without their addresses: browse `_smoltorrent._tcp.local.` with zeroconf.

Every node advertises itself (worker_server/mdns.py) with its stable node id, protocol
version, port and metrics port. `smoltorrent discover` browses for a few seconds and
lists what answered; `--register` and the worker's continuous browse
(SMOLTORRENT_DISCOVER=1) register it. A node is registered by its id, which it keeps in
its data directory: a node that comes back at another address (DHCP) is the same node
at a new address, and its shards, recorded by id, stay its own.

An advert is a claim, not a proof: anyone on the link can advertise any id, at any
address. A node found is registered only once it proves the cluster key in the keyed
handshake (worker_server/wire.py) at the advertised address, as the id it claims. With
no cluster key nothing found is registered (register() refuses): a keyless handshake
proves nothing, so an advert alone could add a stranger or move a registered node's id,
and its shards, to the advertiser. `discover` still lists what it saw. Nor does the proof
bind the address: a relay forwarding the handshake to the node passes it. So a known node
moves only once its registered address no longer answers as that node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from coordinator.dataplane.node_client import NodeAddress, NodeClient
from coordinator.state.metadata import Metadata
from coordinator.state.nodes import NodeRecord
from smoltorrent import defaults
from smoltorrent.errors import ConfigError, SmoltorrentError

log = logging.getLogger("smoltorrent.discovery")

SERVICE = "_smoltorrent._tcp.local."  # what worker_server/mdns.py answers for
NO_KEY = (
    "no cluster key: a node found over mDNS is registered only once it proves the key, and"
    " without one it cannot. Make the key with `smoltorrent init` (or set"
    " SMOLTORRENT_CLUSTER_KEY_FILE), or register a node you trust by address:"
    " smoltorrent nodes add HOST"
)


@dataclass(frozen=True)
class Found:
    """One node that answered, as its advert describes it."""

    node_id: str
    hosts: tuple[str, ...]  # its IPv4 addresses; during a move, the old one may linger
    port: int
    protocol: int | None
    metrics_port: int | None
    instance: str

    @property
    def address(self) -> NodeAddress:
        return NodeAddress(self.hosts[0], self.port)

    def to_dict(self) -> dict:
        return {**asdict(self), "hosts": list(self.hosts), "address": str(self.address)}


def found_from(info: ServiceInfo) -> Found | None:
    """The advert's content; None if it is not one of ours or names no IPv4 address."""
    props = {k.decode("utf-8", "replace"): (v or b"").decode("utf-8", "replace")
             for k, v in (info.properties or {}).items()}  # fmt: skip
    addresses = info.parsed_addresses(IPVersion.V4Only)
    if not props.get("id") or not addresses or not info.port:
        return None

    def number(key: str) -> int | None:
        return int(props[key]) if props.get(key, "").isdigit() else None

    return Found(
        node_id=props["id"],
        hosts=tuple(addresses),
        port=int(info.port),
        protocol=number("proto"),
        metrics_port=number("metrics"),
        instance=info.name,
    )


class _Names(ServiceListener):
    """Collects instance names from zeroconf's thread; resolving happens elsewhere."""

    def __init__(self) -> None:
        self.changed = threading.Event()
        self.lock = threading.Lock()
        self.pending: set[str] = set()

    def _note(self, name: str) -> None:
        with self.lock:
            self.pending.add(name)
        self.changed.set()

    def take(self) -> set[str]:
        with self.lock:
            names, self.pending = self.pending, set()
        self.changed.clear()
        return names

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._note(name)

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self._note(name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        pass  # a node that leaves stays registered: `nodes ls` shows it down


def _resolve(zc: Zeroconf, name: str) -> Found | None:
    info = zc.get_service_info(SERVICE, name, timeout=defaults.DISCOVER_RESOLVE_TIMEOUT_MS)
    return found_from(info) if info is not None else None


def browse(timeout_s: float = defaults.DISCOVER_TIMEOUT_S) -> list[Found]:
    """Every node that answers within timeout_s, one per node id (its latest address)."""
    zc = Zeroconf(ip_version=IPVersion.V4Only)
    names = _Names()
    found: dict[str, Found] = {}
    try:
        browser = ServiceBrowser(zc, SERVICE, listener=names)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            names.changed.wait(left)
            for name in names.take():
                if (item := _resolve(zc, name)) is not None:
                    found[item.node_id] = item
        browser.cancel()
    finally:
        zc.close()
    return sorted(found.values(), key=lambda f: f.node_id)


def register(md: Metadata, found: Found, cluster_key: bytes | None) -> tuple[str, NodeAddress]:
    """Register a found node by its id at the first of its addresses where it answers as
    that node: ("added" | "moved" (a known id at a new address) | "known", the address).
    SmoltorrentError if it answers nowhere as the node it claims to be; ConfigError with
    no cluster key (nothing to prove)."""
    if not cluster_key:
        raise ConfigError(NO_KEY)
    errors = []
    for host in found.hosts:
        address = NodeAddress(host, found.port)
        try:
            client = NodeClient(
                address, cluster_key=cluster_key, timeout=defaults.CONNECT_TIMEOUT_S
            )
            stat = client.stat()
        except SmoltorrentError as exc:
            errors.append(f"{address}: {exc}")
            continue
        if stat.node_id != found.node_id:
            errors.append(f"{address} answers as node {stat.node_id[:12]}")
            continue
        known = md.nodes.nodes().get(stat.node_id)
        if known is not None and known.address != address and _answers_as(known, cluster_key):
            # A relay passes the keyed handshake by forwarding it to the node: the proof
            # does not bind the address. A node still answering where it is registered
            # has not moved, whoever advertises it elsewhere.
            raise SmoltorrentError(
                f"node {found.node_id[:12]} advertised at {address} still answers at its"
                f" registered address {known.address}: not moved (another machine may be"
                " relaying it; `smoltorrent nodes add` moves a node you know has moved)"
            )
        md.nodes.mark_alive(stat.node_id, stat.__dict__)
        if known is not None and known.address == address:
            return "known", address
        # By id: placement names node ids, so a moved node keeps every shard it holds.
        md.nodes.add_node(stat.node_id, address)
        return ("added" if known is None else "moved"), address
    raise SmoltorrentError(
        f"node {found.node_id[:12]} advertised itself but was not registered: " + "; ".join(errors)
    )


def _answers_as(known: NodeRecord, cluster_key: bytes) -> bool:
    """Whether the registered node still answers, as itself, at its registered address."""
    try:
        client = NodeClient(
            known.address, cluster_key=cluster_key, timeout=defaults.CONNECT_TIMEOUT_S
        )
        return client.stat().node_id == known.node_id
    except SmoltorrentError:
        return False


class Browser:
    """Browses until stop() and hands every node found (or found again, at a new address,
    after a goodbye or an announcement) to on_found, from one thread of its own. Every
    DISCOVER_REFRESH_S it resolves the known names again, in case an update was missed."""

    def __init__(self, on_found: Callable[[Found], None]) -> None:
        self.on_found = on_found
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="smoltorrent-discover", daemon=True)
        self._names = _Names()

    def start(self) -> Browser:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._names.changed.set()
        self._thread.join(defaults.DISCOVER_TIMEOUT_S * 2)

    def _run(self) -> None:
        zc = Zeroconf(ip_version=IPVersion.V4Only)
        known: set[str] = set()
        try:
            browser = ServiceBrowser(zc, SERVICE, listener=self._names)
            next_refresh = time.monotonic() + defaults.DISCOVER_REFRESH_S
            while not self._stop.is_set():
                self._names.changed.wait(max(0.0, next_refresh - time.monotonic()))
                names = self._names.take()
                if time.monotonic() >= next_refresh:
                    names |= known
                    next_refresh = time.monotonic() + defaults.DISCOVER_REFRESH_S
                for name in names:
                    if self._stop.is_set():
                        break
                    known.add(name)
                    self._hand_over(zc, name)
            browser.cancel()
        finally:
            zc.close()

    def _hand_over(self, zc: Zeroconf, name: str) -> None:
        try:
            item = _resolve(zc, name)
            if item is not None:
                self.on_found(item)
        except Exception as exc:  # one bad node or a Redis hiccup must not end the browse
            log.warning("discovery: %s: %s", name, exc)
