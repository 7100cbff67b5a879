"""docker-compose.yml: every service there, every smoltorrent command one the CLI accepts,
every file it mounts in the repository, Prometheus scraping the ports the commands open,
and the usage in its header working as written. `docker compose config` (or the standalone
`docker-compose`) checks the file itself where one is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from coordinator.cli.parser import build_parser

yaml = pytest.importorskip("yaml", reason="PyYAML is in the test extra: bootstrap.sh test")

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"redis", "node1", "node2", "node3", "node4", "worker", "beat", "watcher", "flower"}
SERVICES |= {"prometheus", "grafana"}


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_service_is_there_and_each_command_is_one_the_cli_takes() -> None:
    services = compose()["services"]
    assert set(services) == SERVICES
    ours = {name: s for name, s in services.items() if s.get("image") == "smoltorrent:latest"}
    assert set(ours) == SERVICES - {"redis", "prometheus", "grafana"}
    for name, service in ours.items():
        assert "entrypoint" not in service, f"{name}: the image's entrypoint is smoltorrent"
        args = build_parser().parse_args(service["command"])  # a usage error raises
        expected = {"watcher": "watch"}.get(name, name.rstrip("1234"))
        assert args.command == ("serve" if expected == "node" else expected), name
    assert compose()["services"]["beat"]["environment"]["SMOLTORRENT_CLUSTER_KEY"]


def test_mounted_files_exist_and_prometheus_scrapes_the_ports_the_commands_open() -> None:
    services = compose()["services"]
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and source != "./checkpoints":
                assert (ROOT / source).is_file(), f"{name} mounts {source}, which is missing"
    ports = {}
    for name, service in services.items():
        command = service.get("command") or []
        for flag in ("--metrics-port", "--port"):  # what Prometheus reads: metrics first
            if flag in command:
                ports.setdefault(name, int(command[command.index(flag) + 1]))
    config = yaml.safe_load((ROOT / "deploy/compose/prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    }
    expected = {f"node{i}:{ports['node1']}" for i in range(1, 5)}
    expected |= {f"worker:{ports['worker']}", f"flower:{ports['flower']}"}
    assert targets == expected


def test_the_headers_gather_writes_where_the_worker_may_write() -> None:
    """The header's `gather ... -o /checkpoints/...` ran in the worker's container was
    refused (gathers write only under SMOLTORRENT_GATHER_DIRS) until the worker listed it."""
    header = (ROOT / "docker-compose.yml").read_text().split("\nx-smoltorrent")[0]
    outputs = re.findall(r"exec worker smoltorrent gather \S+ -o (\S+)", header)
    assert outputs, "the header shows a gather"
    worker = compose()["services"]["worker"]
    allowed = worker["environment"]["SMOLTORRENT_GATHER_DIRS"].split(":")
    mounts = [v.split(":")[1] for v in worker["volumes"]]
    for output in outputs:
        parent = str(Path(output).parent)
        assert parent in allowed and parent in mounts, (output, allowed, mounts)


def compose_command() -> list[str]:
    """Docker's compose plugin, else the standalone docker-compose (Debian's 1.29)."""
    docker = shutil.which("docker")
    if docker is not None:
        plugin = subprocess.run([docker, "compose", "version"], capture_output=True, text=True)
        if plugin.returncode == 0:
            return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    if standalone is not None:
        return [standalone]
    pytest.skip(
        "neither `docker compose` nor `docker-compose` here (Debian: apt-get install"
        " --no-install-recommends docker-compose; .ci/run does on a root Debian box): the"
        " checks above stand in for `config`"
    )


def test_docker_compose_config_accepts_it() -> None:
    env = dict(os.environ, SMOLTORRENT_CLUSTER_KEY="x" * 64)
    done = subprocess.run(
        [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
