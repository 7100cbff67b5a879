"""The node's Prometheus metrics, in the text exposition format, standard library only.

A storage node installs nothing but Python, so this is the small part of
prometheus-client a node needs: counters and one histogram kept in memory,
gauges read from the blob store at scrape time, and an HTTP endpoint for
`/metrics` (text format 0.0.4). It is served only when a metrics port is given.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from smoltorrent import defaults

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Gauges = Callable[[], dict[str, float]]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class NodeMetrics:
    """What one node counts; thread-safe, cheap enough to update on every request."""

    def __init__(self, node_id: str, gauges: Gauges | None = None, address: str = "") -> None:
        self.node_id = node_id
        # host:port it serves on, labelled beside the id: a person reads which machine.
        self.address = address
        self.gauges = gauges or dict
        self._lock = threading.Lock()
        self._bytes_received = 0
        self._bytes_sent = 0
        self._bytes_scrubbed = 0
        self._connections_accepted = 0
        self._verify_failures: dict[str, int] = {"put": 0, "at_rest": 0}
        self._buckets = defaults.NODE_REQUEST_BUCKETS_S
        # op -> [count per bucket (not cumulative)..., +Inf count], sum
        self._requests: dict[str, tuple[list[int], list[float]]] = {}

    def received(self, n: int) -> None:
        with self._lock:
            self._bytes_received += n

    def sent(self, n: int) -> None:
        with self._lock:
            self._bytes_sent += n

    def connection_accepted(self) -> None:
        with self._lock:
            self._connections_accepted += 1

    def scrubbed(self, n: int) -> None:
        with self._lock:
            self._bytes_scrubbed += n

    def verify_failed(self, where: str, n: int = 1) -> None:
        """where: "put" (a blob arrived with the wrong digest) or "at_rest" (a re-hash)."""
        with self._lock:
            self._verify_failures[where] = self._verify_failures.get(where, 0) + n

    def observe_request(self, op: str, seconds: float) -> None:
        with self._lock:
            counts, total = self._requests.setdefault(op, ([0] * (len(self._buckets) + 1), [0.0]))
            index = next(
                (i for i, bound in enumerate(self._buckets) if seconds <= bound),
                len(self._buckets),
            )
            counts[index] += 1
            total[0] += seconds

    def render(self) -> bytes:
        """Every metric in the Prometheus text format."""
        gauges = self.gauges()
        with self._lock:
            received, sent = self._bytes_received, self._bytes_sent
            scrubbed = self._bytes_scrubbed
            accepted = self._connections_accepted
            failures = dict(self._verify_failures)
            requests = {op: (list(c), t[0]) for op, (c, t) in self._requests.items()}
        node = (("node", self.node_id),) + ((("address", self.address),) if self.address else ())
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        def sample(name: str, value: float, labels: tuple[tuple[str, str], ...] = ()) -> None:
            out.append(f"{name}{_labels(node + labels)} {_number(value)}")

        family("smoltorrent_node_info", "gauge", "This node's id and wire protocol version.")
        sample("smoltorrent_node_info", 1, (("protocol", str(defaults.PROTOCOL_VERSION)),))
        family("smoltorrent_node_bytes_received_total", "counter", "Blob bytes stored here.")
        sample("smoltorrent_node_bytes_received_total", received)
        family("smoltorrent_node_bytes_sent_total", "counter", "Blob bytes read or pushed.")
        sample("smoltorrent_node_bytes_sent_total", sent)
        family(
            "smoltorrent_node_scrubbed_bytes_total", "counter", "Blob bytes re-hashed by scrubs."
        )
        sample("smoltorrent_node_scrubbed_bytes_total", scrubbed)
        # Beside the open-connections gauge: a client that opens one per request shows here.
        family(
            "smoltorrent_node_connections_accepted_total",
            "counter",
            "Client connections accepted, refused ones included.",
        )
        sample("smoltorrent_node_connections_accepted_total", accepted)
        family(
            "smoltorrent_node_verify_failures_total",
            "counter",
            "Blobs whose bytes did not hash to their digest, on arrival or at rest.",
        )
        for where, count in sorted(failures.items()):
            sample("smoltorrent_node_verify_failures_total", count, (("where", where),))
        for name, help_text in (
            ("blobs", "Blobs held."),
            ("used_bytes", "Bytes of blobs held."),
            ("free_bytes", "Bytes free on the data directory's file system."),
            ("connections", "Client connections open now."),
            ("quarantined", "Bad copies held in quarantine, awaiting repair."),
        ):
            if name in gauges:
                family(f"smoltorrent_node_{name}", "gauge", help_text)
                sample(f"smoltorrent_node_{name}", gauges[name])
        name = "smoltorrent_node_request_seconds"
        family(name, "histogram", "Time to serve one request, by operation.")
        for op, (counts, total) in sorted(requests.items()):
            cumulative = 0
            for bound, count in zip((*self._buckets, math.inf), counts, strict=True):
                cumulative += count
                sample(f"{name}_bucket", cumulative, (("op", op), ("le", _number(bound))))
            sample(f"{name}_sum", total, (("op", op),))
            sample(f"{name}_count", cumulative, (("op", op),))
        return ("\n".join(out) + "\n").encode("utf-8")


class _Handler(BaseHTTPRequestHandler):
    metrics: NodeMetrics  # set on the subclass made per server
    timeout = defaults.METRICS_REQUEST_TIMEOUT_S  # per read and write: a silent client goes

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body = self.metrics.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        log.debug("metrics %s: " + format, self.client_address[0], *args)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per request, at most METRICS_MAX_CONNECTIONS at once: one more is closed
    unanswered (a scraper retries at its next interval), and a thread that cannot start
    costs that request only."""

    daemon_threads = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(defaults.METRICS_MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.warning("metrics: refusing %s: scrapes are at their cap", client_address[0])
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise  # socketserver logs it and closes the request; the server goes on

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(metrics: NodeMetrics, host: str, port: int) -> ThreadingHTTPServer:
    """Serve /metrics on host:port from a daemon thread; the caller shuts it down."""
    handler = type("MetricsHandler", (_Handler,), {"metrics": metrics})
    server = _BoundedHTTPServer((host, port), handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
