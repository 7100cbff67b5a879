"""The shard server: accepts connections and serves each in its own thread.

At most MAX_CONNECTIONS sessions run at once; one more gets a `busy` error
frame. SIGTERM or SIGINT stops accepting, lets running requests finish for a
grace period, and exits cleanly.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from smoltorrent import defaults
from smoltorrent.cluster_key import KEY_ENV as CLUSTER_KEY_ENV
from smoltorrent.cluster_key import key_from_env, read_key_file
from smoltorrent.errors import ConfigError, SmoltorrentError
from worker_server import protocol, wire
from worker_server.blob_store import BlobStore, write_file_atomically
from worker_server.limits import AddressSlots, MemoryBudget
from worker_server.mdns import Advert, start_advert
from worker_server.metrics import NodeMetrics, serve_metrics
from worker_server.scrub import Scrubber
from worker_server.session import Session
from worker_server.token_bucket import TokenBucket

log = logging.getLogger(__name__)
# accept() errors that say the node is short of descriptors or memory for now, not that
# the listener is gone: the node waits a moment and accepts again
_ACCEPT_STARVED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

SOCKET_TIMEOUT_ENV = "SMOLTORRENT_SOCKET_TIMEOUT_S"
METRICS_PORT_ENV = "SMOLTORRENT_METRICS_PORT"
METRICS_HOST_ENV = "SMOLTORRENT_METRICS_HOST"
SCRUB_RATE_ENV = "SMOLTORRENT_SCRUB_RATE_BPS"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PORT_FILE = "port"  # in the data dir: the port actually bound, for tests and embedded clusters
METRICS_PORT_FILE = "metrics_port"  # in the data dir: the metrics port actually bound


class ShardServer:
    """A listening socket and the sessions it has accepted."""

    def __init__(
        self,
        store: BlobStore,
        host: str,
        port: int,
        cluster_key: bytes | None,
        socket_timeout: float = defaults.SOCKET_TIMEOUT_S,
        scrub_rate_bps: int = defaults.SCRUB_RATE_BPS,
    ) -> None:
        self.store = store
        self.cluster_key = cluster_key
        self.socket_timeout = socket_timeout
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Restarting right after a crash must not wait out TIME_WAIT on the node's port.
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(defaults.LISTEN_BACKLOG)
        except OSError:
            self._listener.close()
            raise
        self._listener.settimeout(defaults.ACCEPT_POLL_S)
        self.host, self.port = self._listener.getsockname()[:2]
        self._free_slots = threading.BoundedSemaphore(defaults.MAX_CONNECTIONS)
        self._address_slots = AddressSlots(defaults.MAX_CONNECTIONS_PER_ADDRESS)
        self.body_budget = MemoryBudget(defaults.JSON_BODY_BUDGET_BYTES)
        self._sessions: set[threading.Thread] = set()
        self._sessions_lock = threading.Lock()
        self._stopping = threading.Event()
        self.metrics = NodeMetrics(store.node_id, self._gauges, self._address())
        self.scrubber = Scrubber(store, scrub_rate_bps, self.metrics)
        # One for every session: a node's repair pushes keep to one rate together.
        self.repair_bucket = TokenBucket(defaults.REPAIR_BPS)

    def _address(self) -> str:
        """host:port as the cluster registers it: the bound host, or this machine's name
        when bound to every interface."""
        wildcard = self.host in ("0.0.0.0", "::", "")
        host = socket.gethostname() if wildcard else self.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _gauges(self) -> dict[str, float]:
        stat = self.store.stat()
        with self._sessions_lock:
            connections = len(self._sessions)
        return {
            "blobs": stat["blob_count"],
            "used_bytes": stat["used_bytes"],
            "free_bytes": stat["free_bytes"],
            "connections": connections,
            "quarantined": len(self.store.quarantined()),
        }

    def stop(self) -> None:
        """Ask serve_forever to return; safe from a signal handler or another thread."""
        self._stopping.set()

    def close(self) -> None:
        """Stop listening; sessions already running carry on."""
        self._listener.close()

    def serve_forever(self) -> None:
        starved = False
        try:
            while not self._stopping.is_set():
                try:
                    conn, address = self._listener.accept()
                except TimeoutError:
                    continue  # wake up to check for a stop request
                except OSError as exc:
                    if exc.errno not in _ACCEPT_STARVED:
                        raise
                    # Out of descriptors or memory for now: the peer waits in the backlog
                    # and is accepted once some frees up. The node serves on.
                    if not starved:
                        log.warning("cannot accept connections for now: %s", exc)
                    starved = True
                    self._stopping.wait(defaults.ACCEPT_RETRY_S)
                    continue
                if starved:
                    log.warning("accepting connections again")
                    starved = False
                self._start_session(conn, f"{address[0]}:{address[1]}")
        finally:
            self._listener.close()
            self.scrubber.stop()
            self._wait_for_sessions()

    def _start_session(self, conn: socket.socket, peer: str) -> None:
        self.metrics.connection_accepted()
        conn.settimeout(self.socket_timeout)
        if not self._free_slots.acquire(blocking=False):
            _refuse(
                conn,
                f"refusing {peer}: {defaults.MAX_CONNECTIONS} connections are open",
                f"this node is serving {defaults.MAX_CONNECTIONS} connections already:"
                " retry shortly or use fewer parallel transfers",
            )
            return
        if not self._address_slots.acquire(_host_of(peer)):
            self._free_slots.release()
            _refuse(
                conn,
                f"refusing {peer}: {defaults.MAX_CONNECTIONS_PER_ADDRESS} connections from"
                " that address are open",
                f"this node serves at most {defaults.MAX_CONNECTIONS_PER_ADDRESS} connections"
                " from one address: retry shortly or use fewer parallel transfers",
            )
            return
        thread = threading.Thread(target=self._run_session, args=(conn, peer), daemon=True)
        with self._sessions_lock:
            self._sessions.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had (memory, a process limit)
            with self._sessions_lock:
                self._sessions.discard(thread)
            self._address_slots.release(_host_of(peer))
            self._free_slots.release()
            _refuse(
                conn,
                f"refusing {peer}: {exc}",
                "this node cannot start another connection now: retry shortly",
            )

    def _run_session(self, conn: socket.socket, peer: str) -> None:
        try:
            Session(
                conn,
                peer,
                self.store,
                self.cluster_key,
                self.socket_timeout,
                body_budget=self.body_budget,
                metrics=self.metrics,
                scrubber=self.scrubber,
                repair_bucket=self.repair_bucket,
            ).run()
        finally:
            self._address_slots.release(_host_of(peer))
            self._free_slots.release()
            with self._sessions_lock:
                self._sessions.discard(threading.current_thread())

    def _wait_for_sessions(self) -> None:
        deadline = time.monotonic() + defaults.SHUTDOWN_GRACE_S
        with self._sessions_lock:
            running = list(self._sessions)
        for thread in running:
            thread.join(max(deadline - time.monotonic(), 0))
        if any(thread.is_alive() for thread in running):
            log.warning("leaving unfinished transfers; their temp files go at next start")


def _refuse(conn: socket.socket, why: str, message: str) -> None:
    """Turn a connection away with a `busy` error frame, and log why once."""
    log.warning("%s", why)
    with contextlib.suppress(OSError):
        wire.send_frame(conn, protocol.error_header("busy", message))
    conn.close()


def _host_of(peer: str) -> str:
    return peer.rpartition(":")[0]


def serve(
    data_dir: str | os.PathLike[str],
    host: str,
    port: int,
    cluster_key: bytes | None,
    ready_callback: Callable[[ShardServer], None] | None = None,
    *,
    socket_timeout: float = defaults.SOCKET_TIMEOUT_S,
    metrics_port: int | None = None,
    metrics_host: str = defaults.METRICS_HOST,
    scrub_rate_bps: int = defaults.SCRUB_RATE_BPS,
    mdns: bool = False,
) -> None:
    """Run a shard server until SIGTERM/SIGINT (from the main thread) or server.stop().

    ready_callback(server) runs once the port is bound and written to <data_dir>/port.
    With a metrics_port, /metrics is served there (its bound port in <data_dir>/metrics_port).
    With mdns, the node advertises itself over multicast DNS (worker_server/mdns.py).
    """
    store = BlobStore(data_dir)
    port_file = Path(data_dir) / PORT_FILE
    metrics_http = None
    advert = None
    try:
        server = ShardServer(store, host, port, cluster_key, socket_timeout, scrub_rate_bps)
        if metrics_port is not None:
            metrics_http = serve_metrics(server.metrics, metrics_host, metrics_port)
            bound = metrics_http.server_address[1]
            write_file_atomically(
                Path(data_dir) / METRICS_PORT_FILE, f"{bound}\n".encode("ascii"), store.tmp_dir
            )
            log.info("metrics on http://%s:%d/metrics", metrics_host, bound)
        # Handlers go in before the port file appears: whoever waits for it may signal at once.
        with _stop_on_signals(server):
            try:
                _announce(server, port_file)
                if mdns:
                    # A metrics port only where a browser's machine could scrape it.
                    reachable = metrics_http is not None and not _is_loopback(metrics_host)
                    bound_metrics = metrics_http.server_address[1] if reachable else None
                    advert = start_advert(
                        Advert(
                            store.node_id, server.port, defaults.PROTOCOL_VERSION, bound_metrics
                        ),
                        host,
                    )
                if ready_callback is not None:
                    ready_callback(server)
                server.serve_forever()
            finally:
                server.close()
        port_file.unlink(missing_ok=True)
        log.info("smoltorrent node %s stopped", store.node_id)
    finally:
        if advert is not None:
            advert.stop()  # a goodbye: browsers drop this node now, not at TTL expiry
        if metrics_http is not None:
            metrics_http.shutdown()
            metrics_http.server_close()
        store.close()


def _announce(server: ShardServer, port_file: Path) -> None:
    """Warn if keyless, write the bound port for local tools, log the listening line."""
    if not server.cluster_key:
        log.warning(
            "NO CLUSTER KEY: anyone who can reach %s:%d can read, write and delete blobs."
            " Set %s_FILE or pass --key-file on every node (`smoltorrent init` makes the key).",
            server.host,
            server.port,
            CLUSTER_KEY_ENV,
        )
    write_file_atomically(port_file, f"{server.port}\n".encode("ascii"), server.store.tmp_dir)
    log.info(
        "smoltorrent node %s listening on %s:%d (data: %s)",
        server.store.node_id,
        server.host,
        server.port,
        server.store.root,
    )


@contextlib.contextmanager
def _stop_on_signals(server: ShardServer) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals only reach the main thread; an embedding caller stops us itself
        return
    previous = {
        signum: signal.signal(signum, lambda received, frame: server.stop())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class UnsafeListenError(SmoltorrentError):
    """A node was told to listen beyond loopback without a cluster key, or on no valid port."""


def listen_address(host: str | None, port: int, has_key: bool, insecure: bool) -> str:
    """The address to bind: all interfaces with a key, loopback without one; refused when
    a keyless node is told to listen where others can reach it, unless `insecure`."""
    if not 0 <= port <= 65535:
        raise UnsafeListenError(
            f"port {port} is not a TCP port: use 1-65535 (or 0 to pick a free one);"
            f" the default is {defaults.DEFAULT_PORT}"
        )
    if host is None:
        return "0.0.0.0" if has_key else "127.0.0.1"
    if has_key or insecure or _is_loopback(host):
        return host
    raise UnsafeListenError(
        f"refusing to listen on {host} without a cluster key: anyone who can reach it could"
        " read, write and delete blobs. Make the key once with `smoltorrent init` (on the"
        " training box; it writes ~/.smoltorrent/cluster.key), copy that file here, then run"
        " `smoltorrent serve --key-file PATH ...` (or set SMOLTORRENT_CLUSTER_KEY_FILE=PATH);"
        " every node, training and reading machine uses the same key. Or pass --insecure if"
        " you accept that"
    )


def _is_loopback(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return False
    return all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def run_from_args(
    data_dir: str,
    host: str | None,
    port: int,
    cluster_key: str | None,
    socket_timeout: float | None = None,
    metrics_port: int | None = None,
    *,
    metrics_host: str | None = None,
    key_file: str | None = None,
    insecure: bool = False,
    mdns: bool = True,
) -> int:
    """The CLI's entry point: serve until stopped; the process exit status (2: refused
    configuration)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        key = node_key(cluster_key, key_file)
        host = listen_address(host, port, key is not None, insecure)
        timeout = _socket_timeout(socket_timeout)
        serve(
            data_dir,
            host,
            port,
            key,
            socket_timeout=timeout,
            metrics_port=metrics_port_from(metrics_port),
            metrics_host=metrics_host_from(metrics_host),
            scrub_rate_bps=scrub_rate_from_env(),
            mdns=mdns,
        )
    except (UnsafeListenError, ConfigError) as exc:
        log.error("%s", exc)
        return 2
    except SmoltorrentError as exc:
        log.error("%s", exc)
        return 1
    except OSError as exc:
        log.error(
            "cannot serve %s on %s:%d (%s): check that the address is this machine's, that no"
            " other process holds the port, and that the data directory is writable",
            data_dir,
            host,
            port,
            exc.strerror or exc,
        )
        return 1
    return 0


def node_key(flag_key: str | None, flag_file: str | None) -> bytes | None:
    """--cluster-key, else --key-file, else SMOLTORRENT_CLUSTER_KEY, else the file
    SMOLTORRENT_CLUSTER_KEY_FILE names, else None (smoltorrent/cluster_key.py)."""
    if flag_key:
        return flag_key.encode("utf-8")
    if flag_file:
        return read_key_file(flag_file)
    return key_from_env()


def _socket_timeout(flag_value: float | None) -> float:
    """The --socket-timeout flag, else SMOLTORRENT_SOCKET_TIMEOUT_S, else the default."""
    text = os.environ.get(SOCKET_TIMEOUT_ENV) if flag_value is None else str(flag_value)
    if not text:
        return defaults.SOCKET_TIMEOUT_S
    try:
        timeout = float(text)
    except ValueError:
        timeout = math.nan
    if not 0 < timeout < math.inf:
        raise SmoltorrentError(
            f"socket timeout {text!r} is not a positive number of seconds: fix --socket-timeout"
            f" or {SOCKET_TIMEOUT_ENV}"
        )
    return timeout


def metrics_port_from(flag_value: int | None) -> int | None:
    """--metrics-port, else SMOLTORRENT_METRICS_PORT, else None (no metrics served)."""
    if flag_value is not None:
        return flag_value
    text = os.environ.get(METRICS_PORT_ENV)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise SmoltorrentError(
            f"{METRICS_PORT_ENV}={text!r} is not a port number: set it to a free TCP port"
            " (0 picks one) or unset it to serve no metrics"
        ) from None


def metrics_host_from(flag_value: str | None) -> str:
    """--metrics-host, else SMOLTORRENT_METRICS_HOST, else 127.0.0.1: /metrics has no login,
    so it is served beyond this machine only when asked."""
    return flag_value or os.environ.get(METRICS_HOST_ENV) or defaults.METRICS_HOST


def scrub_rate_from_env() -> int:
    """SMOLTORRENT_SCRUB_RATE_BPS, else the default: bytes/s this node re-hashes at most."""
    text = os.environ.get(SCRUB_RATE_ENV)
    if not text:
        return defaults.SCRUB_RATE_BPS
    try:
        rate = int(text)
    except ValueError:
        rate = 0
    if rate <= 0:
        raise SmoltorrentError(
            f"{SCRUB_RATE_ENV}={text!r} is not a positive whole number of bytes per second:"
            f" fix it or unset it for the default ({defaults.SCRUB_RATE_BPS})"
        )
    return rate
