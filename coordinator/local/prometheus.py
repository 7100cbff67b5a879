"""A real Prometheus (Debian's `prometheus` binary) on a directory of its own, scraping a
local cluster's nodes and worker every second: for the metrics test and bench/dashboard.py,
which ask it what the Grafana dashboard asks, over its HTTP API."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "smoltorrent.json"


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def dashboard_panels(path: Path = DASHBOARD) -> list[dict]:
    """Every panel of the Grafana dashboard that queries something, rows flattened."""

    def walk(panels):
        for panel in panels:
            if panel.get("targets"):
                yield panel
            yield from walk(panel.get("panels", []))

    return list(walk(json.loads(path.read_text())["panels"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


class LocalPrometheus:
    """prometheus on 127.0.0.1 with its config and data under `root`; targets: job -> hosts."""

    def __init__(self, root: Path, targets: dict[str, list[str]]) -> None:
        binary = prometheus_binary()
        if binary is None:
            raise SmoltorrentError("Prometheus is not installed (Debian: apt install prometheus)")
        root.mkdir(parents=True)
        scrape = f"{defaults.LOCAL_PROMETHEUS_SCRAPE_S}s"
        config = {
            "global": {"scrape_interval": scrape, "evaluation_interval": scrape},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        # JSON is YAML: no YAML library needed to write the config.
        (root / "prometheus.yml").write_text(json.dumps(config))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = root / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={root / 'prometheus.yml'}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise SmoltorrentError(f"prometheus exited: {self.log.read_text()[-2000:]}")
        try:
            return _get(self.url + "/-/ready").startswith(b"Prometheus")
        except OSError:
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + defaults.LOCAL_PROMETHEUS_START_S
        while not self.ready():
            if time.monotonic() > deadline:
                raise SmoltorrentError(f"prometheus did not start; see {self.log}")
            time.sleep(0.2)

    def targets_up(self) -> list[str]:
        data = json.loads(_get(self.url + "/api/v1/targets"))["data"]["activeTargets"]
        return [t["scrapeUrl"] for t in data if t["health"] == "up"]

    def _api(self, path: str, **params: str) -> list:
        body = json.loads(_get(f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)))
        if body["status"] != "success":
            raise SmoltorrentError(f"prometheus answered {body}")
        return body["data"]["result"]

    def query(self, expr: str) -> list:
        """Instant vector: [{"metric": labels, "value": [t, "v"]}, ...]."""
        return self._api("query", query=expr)

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        """Matrix: [{"metric": labels, "values": [[t, "v"], ...]}, ...]."""
        return self._api("query_range", query=expr, start=str(start), end=str(end), step=str(step))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
