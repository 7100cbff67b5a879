"""deploy/'s systemd units and launchd plist run commands the CLI accepts today, with the
ports deploy/prometheus.yml scrapes, and give `smoltorrent up` the time it takes to stop:
so they cannot rot while the CLI moves on."""

from __future__ import annotations

import configparser
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from coordinator.cli.parser import build_parser
from smoltorrent import defaults

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNITS = sorted(DEPLOY.glob("*.service"))
PLISTS = sorted(DEPLOY.glob("*.plist"))
# Worst case for `up` to stop: the worker's grace, then beat's and the watcher's.
UP_STOP_S = defaults.UP_WORKER_GRACE_S + 2 * defaults.UP_GRACE_S


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(path.read_text())
    return parser


def exec_start(path: Path) -> list[str]:
    return shlex.split(unit(path)["Service"]["ExecStart"])


def program(path: Path) -> list[str]:
    return plistlib.loads(path.read_bytes())["ProgramArguments"]


def console_script() -> str:
    (name,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    return name


def scraped_port(job: str) -> int:
    """The port of job's targets in deploy/prometheus.yml (one port for the whole job)."""
    text = (DEPLOY / "prometheus.yml").read_text()
    section = text.split(f"job_name: {job}\n")[1].split("job_name:")[0]
    ports = {int(p) for p in re.findall(r"[\w.-]+:(\d+)", section)}
    assert len(ports) == 1, (job, ports)
    return ports.pop()


def test_the_units_are_a_node_and_a_coordinator() -> None:
    assert [u.name for u in UNITS] == [
        "smoltorrent-coordinator.service",
        "smoltorrent-node.service",
    ]
    assert [p.name for p in PLISTS] == ["com.smoltorrent.worker.plist"]


@pytest.mark.parametrize(
    "argv",
    [exec_start(u) for u in UNITS] + [program(p) for p in PLISTS],
    ids=[p.name for p in UNITS + PLISTS],
)
def test_every_command_line_is_one_the_cli_takes(argv: list[str]) -> None:
    assert Path(argv[0]).name == console_script(), argv
    build_parser().parse_args(argv[1:])  # a usage error raises SystemExit
    # The real program too, as the service manager starts it (--help: nothing runs).
    subcommand = argv[1]
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", subcommand, "--help"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    for flag in (a for a in argv[2:] if a.startswith("--")):
        assert flag in done.stdout, f"{flag} is not an option of {subcommand}"


def test_a_node_serves_metrics_where_prometheus_scrapes_and_advertises_itself() -> None:
    argv = exec_start(DEPLOY / "smoltorrent-node.service")
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"
    assert args.metrics_port == scraped_port("smoltorrent-nodes")
    assert not args.no_mdns  # discovery is on by default; the unit keeps it on
    families = unit(DEPLOY / "smoltorrent-node.service")["Service"]["RestrictAddressFamilies"]
    # The advert needs IPv4 multicast and the interface list (netlink).
    assert {"AF_INET", "AF_NETLINK"} <= set(families.split())


def test_the_coordinator_side_runs_up_with_metrics_and_time_to_stop() -> None:
    assert scraped_port("smoltorrent-worker") == defaults.UP_WORKER_METRICS
    service = unit(DEPLOY / "smoltorrent-coordinator.service")["Service"]
    for argv in (exec_start(DEPLOY / "smoltorrent-coordinator.service"), program(PLISTS[0])):
        args = build_parser().parse_args(argv[1:])
        assert args.command == "up" and args.metrics and args.nodes == 0 and args.watch, argv
    # SIGTERM to up alone: it stops its parts in order; systemd must not signal them all.
    assert service["KillMode"] == "mixed"
    assert float(service["TimeoutStopSec"]) >= UP_STOP_S
    assert plistlib.loads(PLISTS[0].read_bytes())["ExitTimeOut"] >= UP_STOP_S


@pytest.mark.parametrize("path", UNITS, ids=[u.name for u in UNITS])
def test_systemd_accepts_the_unit(path: Path, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze here (Debian: the systemd package)")
    # The installed console script's path, made the real one of this checkout's venv.
    real = shutil.which(console_script(), path=str(Path(sys.executable).parent))
    assert real, "the smoltorrent console script is not installed in this venv"
    copy = tmp_path / path.name
    copy.write_text(path.read_text().replace(exec_start(path)[0], real))
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    # verify exits 0 even for unknown keys or bad values: what it prints is the verdict.
    problems = [line for line in done.stderr.splitlines() if str(copy) in line]
    assert done.returncode == 0 and not problems, done.stderr
