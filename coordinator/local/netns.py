"""An emulated LAN: every host a network namespace of its own, wired to a switch.

A switch namespace holds a bridge; every host is joined to it by a veth pair,
optionally shaped with tbf on BOTH ends (full duplex: R Mbit/s up and R Mbit/s
down per port, as a Pi's Fast Ethernet behind a switch). A host's port can be
taken down on the switch side: a cable pulled, so packets vanish and nobody
gets a reset. Two hosts can be cut from each other alone (`sever`: each one's
neighbour entry for the other points at a MAC nobody has, so the switch floods
their frames to no taker), the rest of the LAN untouched; no packet filter is
needed (this kernel has no nftables, iptables or tc actions). One host may stay
in the caller's own namespace (`local_host`): its processes run as they are and
reach the others through a port of the switch like any host. Needs root and
iproute2; everything made is removed by close(), with any process still inside
a namespace killed first, and remove_stale() removes what a killed run left.
The Pi-cluster benchmark, the link-cut tests and the fault runs run real
processes in it with `exec_prefix`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

TBF_LATENCY = "50ms"  # queueing a tbf allows before dropping: a switch port's buffer
# The MAC a severed host's frames go to: locally administered, unicast, owned by nobody.
NOBODY_MAC = "02:00:5e:00:de:ad"
SUBNET_LOCK = "/tmp/smoltorrent-netns-subnet.lock"  # one per machine, as its addresses
CLOSE_TIMEOUT_S = 10.0  # seconds close() waits for the kernel to delete the local link


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
        local_host: str | None = None,
    ) -> None:
        self.hosts = hosts
        self.prefix = prefix  # namespace and link names; unique per run
        self.rate_mbit = rate_mbit  # None: unshaped
        self.subnet = subnet
        self.local_host = local_host  # the host that stays in the caller's namespace
        self.switch = f"{prefix}-sw"
        self.namespaces: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def device(self, host: str) -> str:
        """The host's end of its link: eth0 in its namespace, a named one for local_host."""
        return f"{self.prefix}L"[:15] if host == self.local_host else "eth0"

    def _ip(self, host: str) -> tuple[str, ...]:
        return ("ip",) if host == self.local_host else ("ip", "-n", self.ns(host))

    def port(self, host: str) -> str:
        return f"{self.prefix}{host}"[:15]  # the switch-side end of the host's link

    def address(self, host: str) -> str:
        return f"{self.subnet}.{10 + self.hosts.index(host)}"

    def exec_prefix(self, host: str) -> list[str]:
        return [] if host == self.local_host else ["ip", "netns", "exec", self.ns(host)]

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
            port, dev, ip = self.port(host), self.device(host), self._ip(host)
            if host == self.local_host:
                # Made here and its peer moved to the switch: deleting the switch's
                # namespace deletes this end too, so nothing is left here after close().
                run("ip", "link", "add", dev, "type", "veth", "peer", "name", port,
                    "netns", self.switch)  # fmt: skip
            else:
                run("ip", "netns", "add", self.ns(host))
                self.namespaces.append(self.ns(host))
                run("ip", "-n", self.switch, "link", "add", port, "type", "veth",
                    "peer", "name", dev, "netns", self.ns(host))  # fmt: skip
                run(*ip, "link", "set", "lo", "up")
            run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            run(*ip, "addr", "add", f"{self.address(host)}/24", "dev", dev)
            run(*ip, "link", "set", dev, "up")
            if self.rate_mbit:
                # Both directions of the link: the host's uplink and the port's downlink.
                self._shape(ip, dev)
                self._shape(("ip", "-n", self.switch), port)

    def _shape(self, ip: tuple[str, ...], dev: str) -> None:
        assert self.rate_mbit
        # burst: one 1 ms slice of the line rate, at least a few full frames.
        burst = max(self.rate_mbit * 1_000_000 // 8 // 1000, 8 * 1514)
        rate = f"{self.rate_mbit}mbit"
        tc = ("tc", *ip[1:])  # tc takes ip's -n NS
        run(*tc, "qdisc", "add", "dev", dev, "root", "tbf",
            "rate", rate, "burst", str(burst), "latency", TBF_LATENCY)  # fmt: skip

    def cut(self, host: str) -> None:
        """Unplug: the switch port goes down, packets vanish, nobody gets a reset."""
        run("ip", "-n", self.switch, "link", "set", self.port(host), "down")

    def reconnect(self, host: str) -> None:
        run("ip", "-n", self.switch, "link", "set", self.port(host), "up")

    def sever(self, a: str, b: str) -> None:
        """Cut a and b from each other only: what each sends the other vanishes (no reset,
        no error), while both still reach every other host. Established connections
        between them stall as on a pulled cable."""
        for here, there in ((a, b), (b, a)):
            run(*self._ip(here), "neigh", "replace", self.address(there), "lladdr",
                NOBODY_MAC, "nud", "permanent", "dev", self.device(here))  # fmt: skip

    def mend(self, a: str, b: str) -> None:
        """Undo sever(a, b): each finds the other again by ARP."""
        for here, there in ((a, b), (b, a)):
            run(*self._ip(here), "neigh", "del", self.address(there), "dev",
                self.device(here), check=False)  # fmt: skip

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
        if self.local_host is not None:
            # The kernel deletes the local end after the switch's namespace, a moment later;
            # the next Lan of this prefix makes the same name.
            deadline = time.monotonic() + CLOSE_TIMEOUT_S
            dev = self.device(self.local_host)
            while run("ip", "link", "show", "dev", dev, check=False).returncode == 0:
                if time.monotonic() > deadline:
                    run("ip", "link", "del", dev, check=False)
                    break
                time.sleep(0.05)
        return left


def remove_stale(tag: str) -> list[str]:
    """Remove the namespaces (and with them their links) of runs that were killed before
    close(): those named `<tag><pid>-...` whose pid is gone. Their processes are killed
    first. What was removed, by name."""
    names = run("ip", "netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in names:
        name = line.split(" ")[0]
        found = re.fullmatch(rf"{re.escape(tag)}(\d+)-.*", name)
        if not found or _pid_alive(int(found.group(1))):
            continue
        for pid in run("ip", "netns", "pids", name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        run("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


@contextlib.contextmanager
def subnet_lock() -> Iterator[None]:
    """Held from free_subnet() until the Lan that takes it is open: runs started at once
    (pytest-xdist workers) would otherwise be handed the same subnet."""
    with open(SUBNET_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def free_subnet(first: int = 100) -> str:
    """A 10.X.0 /24 no link on this namespace has an address in (a run's local host
    takes one here, beside other runs'); hold subnet_lock() until it is taken."""
    used = run("ip", "-4", "-o", "addr", "show").stdout
    for x in range(first, 250):
        if f" 10.{x}.0." not in used:
            return f"10.{x}.0"
    raise RuntimeError("no free 10.X.0.0/24 subnet between 10.100 and 10.249")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _command(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
    except OSError:
        return "(gone)"
