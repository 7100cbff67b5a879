"""An emulated LAN: every host a network namespace of its own, wired to a switch.

A switch namespace holds a bridge; every host is joined to it by a veth pair,
optionally shaped with tbf on BOTH ends (full duplex: R Mbit/s up and R Mbit/s
down per port, as a Pi's Fast Ethernet behind a switch). A host's port can be
taken down on the switch side: a cable pulled, so packets vanish and nobody
gets a reset. Needs root and iproute2; everything made is removed by close(),
with any process still inside a namespace killed first. The Pi-cluster
benchmark and the link-cut tests run real processes in it with `exec_prefix`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

TBF_LATENCY = "50ms"  # queueing a tbf allows before dropping: a switch port's buffer


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a sentence), or None when they can."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    name = f"stprobe{os.getpid()}"
    try:
        made = run("ip", "netns", "add", name, check=False)
    except FileNotFoundError:
        return "needs iproute2's `ip` to make network namespaces"
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    run("ip", "netns", "del", name, check=False)
    return None


class Lan:
    """The namespaces, the bridge and the (shaped) veth pairs; open() makes them."""

    def __init__(
        self,
        hosts: list[str],
        *,
        prefix: str,
        rate_mbit: int | None = None,
        subnet: str = "10.77.0",
    ) -> None:
        self.hosts = hosts
        self.prefix = prefix  # namespace and link names; unique per run
        self.rate_mbit = rate_mbit  # None: unshaped
        self.subnet = subnet
        self.switch = f"{prefix}-sw"
        self.namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def port(self, host: str) -> str:
        return f"{self.prefix}{host}"[:15]  # the switch-side end of the host's link

    def address(self, host: str) -> str:
        return f"{self.subnet}.{10 + self.hosts.index(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def open(self) -> Lan:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        run("ip", "netns", "add", self.switch)
        self.namespaces.append(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ns, port = self.ns(host), self.port(host)
            run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            run("ip", "-n", self.switch, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", ns)  # fmt: skip
            run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.rate_mbit:
                # Both directions of the link: the host's uplink and the port's downlink.
                self._shape(ns, "eth0")
                self._shape(self.switch, port)

    def _shape(self, ns: str, dev: str) -> None:
        assert self.rate_mbit
        # burst: one 1 ms slice of the line rate, at least a few full frames.
        burst = max(self.rate_mbit * 1_000_000 // 8 // 1000, 8 * 1514)
        rate = f"{self.rate_mbit}mbit"
        run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", rate, "burst", str(burst), "latency", TBF_LATENCY)  # fmt: skip

    def cut(self, host: str) -> None:
        """Unplug: the switch port goes down, packets vanish, nobody gets a reset."""
        run("ip", "-n", self.switch, "link", "set", self.port(host), "down")

    def reconnect(self, host: str) -> None:
        run("ip", "-n", self.switch, "link", "set", self.port(host), "up")

    def counters(self, hosts: list[str] | None = None) -> dict[str, tuple[int, int]]:
        """Per host: (bytes the host sent, bytes it received), read on the switch side."""
        hosts = self.hosts if hosts is None else hosts
        paths = [
            f"/sys/class/net/{self.port(h)}/statistics/{which}_bytes"
            for h in hosts
            for which in ("rx", "tx")
        ]
        read = run("ip", "netns", "exec", self.switch, "cat", *paths).stdout.split()
        return {h: (int(read[2 * i]), int(read[2 * i + 1])) for i, h in enumerate(hosts)}

    def close(self) -> list[str]:
        """Remove every namespace; the processes that were still in one (killed)."""
        left = []
        for ns in reversed(self.namespaces):
            pids = run("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                left.append(f"{ns}: {pid} {_command(pid)}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            run("ip", "netns", "del", ns, check=False)
        self.namespaces.clear()
        return left


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return "(gone)"
