"""mDNS discovery between real processes on a real (virtual) link.

Each node runs in a network namespace of its own, the coordinator side (Redis, the CLI,
a worker browsing with SMOLTORRENT_DISCOVER=1) in another, all joined by a bridge in a
third: multicast flows only on those interfaces, never on the machine's own network.
The namespaces are created and removed by the test (it needs root and `ip`).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.dataplane.node_client import NodeAddress
from coordinator.discovery import Found, register
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.embedded_redis import free_port, redis_server_binary, start_redis, url_for
from coordinator.state.metadata import Metadata
from smoltorrent import defaults
from smoltorrent.errors import SmoltorrentError
from tests.conftest import require_network_namespaces
from tests.nodeproc import start_node
from tests.tcpproxy import start_proxy

SUBNET = "10.77.{}"  # a private /24 per test run, inside the namespaces only
KEY = "discovery-test-key"  # nodes listen beyond loopback only with a key
NODE_PORT = defaults.DEFAULT_PORT
METRICS_PORT = 9411
WAIT_S = 60.0  # seconds for an event that takes well under one on an idle machine


def ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


class Link:
    """A bridge in a namespace of its own and a namespace per member, each with one
    veth port on the bridge and a default route through it (as a LAN host has)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.subnet = SUBNET.format(os.getpid() % 200 + 10)
        self.spaces: list[str] = []
        self.bridge = self._space("br")
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")

    def _space(self, member: str) -> str:
        name = f"st{self.tag}{member}"
        ip("netns", "add", name)
        self.spaces.append(name)
        return name

    def add(self, member: str, host: int) -> str:
        space = self._space(member)
        port = f"v{member}"
        ip("-n", self.bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0")
        ip("-n", self.bridge, "link", "set", "eth0", "netns", space)
        ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
        ip("-n", space, "link", "set", "lo", "up")
        ip("-n", space, "link", "set", "eth0", "up")
        self.address(member, host)
        return space

    def address(self, member: str, host: int, old: int | None = None) -> str:
        """Give member the address .host (dropping .old): what a DHCP renewal does."""
        space = f"st{self.tag}{member}"
        if old is not None:
            ip("-n", space, "addr", "del", f"{self.subnet}.{old}/24", "dev", "eth0")
        ip("-n", space, "addr", "add", f"{self.subnet}.{host}/24", "dev", "eth0")
        ip("-n", space, "route", "replace", "default", "dev", "eth0")
        return f"{self.subnet}.{host}"

    def pids(self, space: str) -> list[str]:
        out = subprocess.run(["ip", "netns", "pids", space], capture_output=True, text=True)
        return out.stdout.split()

    def close(self) -> list[str]:
        """Remove every namespace; the processes that were still in one (killed)."""
        left = []
        for space in reversed(self.spaces):
            for pid in self.pids(space):
                left.append(f"{space}: {pid}")
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", space], capture_output=True)
        return left


class Stack:
    """The processes of the test, each started with `ip netns exec` in its namespace."""

    def __init__(self, link: Link, root: Path) -> None:
        self.link = link
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.client = link.add("c", 2)
        self.env = dict(
            os.environ,
            SMOLTORRENT_REDIS_URL="redis://127.0.0.1:6379/0",
            SMOLTORRENT_HOME=str(root / "home"),
            SMOLTORRENT_HOST_ID="discoverytest",
            SMOLTORRENT_CLUSTER_KEY=KEY,
            SMOLTORRENT_GATHER_DIRS=str(root),
            PYTHONUNBUFFERED="1",
        )
        self.spawn("redis", self.client, [redis_server_binary(), "--port", "6379"]
                   + ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])  # fmt: skip

    def spawn(self, name: str, space: str, argv: list[str], **env: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(
            ["ip", "netns", "exec", space, *argv],
            env=dict(self.env, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.procs[name]

    def start_node(self, i: int) -> None:
        data = self.root / f"node{i}"
        (data / "port").unlink(missing_ok=True)
        command = [sys.executable, "-m", "worker_server", "--data-dir", str(data)]
        command += ["--host", "0.0.0.0", "--port", str(NODE_PORT)]
        command += ["--metrics-port", str(METRICS_PORT), "--metrics-host", "0.0.0.0"]
        self.spawn(f"node{i}", f"st{self.link.tag}n{i}", command)
        wait_for(lambda: (data / "port").exists(), f"node{i} to listen")

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def cli(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["ip", "netns", "exec", self.client, sys.executable, "-m", "coordinator.cli", *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"smoltorrent {' '.join(argv)}: {result.stdout}{result.stderr}")
        return result

    def cli_json(self, *argv: str):
        return json.loads(self.cli(*argv, "--json").stdout)


def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    require_network_namespaces()  # fails instead of skipping where CI requires namespaces
    link = Link(str(os.getpid() % 10000))
    stack = None
    try:
        stack = Stack(link, tmp_path)
        wait_for(lambda: stack.cli("nodes", "ls", check=False).returncode == 0, "redis")
        yield stack
    finally:
        if stack is not None:
            for name in reversed(list(stack.procs)):
                stack.stop(name)
        left = link.close()
    assert left == [], f"processes left in the test's namespaces: {left}"


def test_discover_finds_every_node_and_the_worker_follows_a_moved_one(
    stack: Stack, tmp_path: Path
) -> None:
    subnet = stack.link.subnet
    for i in range(4):
        stack.link.add(f"n{i}", 11 + i)
        stack.start_node(i)
    ids = {(tmp_path / f"node{i}" / "node_id").read_text().strip(): i for i in range(4)}

    # 1. `discover --json` lists all four, with what each advertises; none registered yet.
    found = stack.cli_json("discover", "--timeout", "3")
    assert {f["node_id"] for f in found} == set(ids)
    for f in found:
        assert f["address"] == f"{subnet}.{11 + ids[f['node_id']]}:{NODE_PORT}"
        assert f["protocol"] == defaults.PROTOCOL_VERSION
        assert f["metrics_port"] == METRICS_PORT
        assert f["registered"] == "no"
    assert stack.cli_json("nodes", "ls") == []

    # 2. A worker browsing continuously registers them by itself.
    stack.spawn(
        "worker",
        stack.client,
        [sys.executable, "-m", "coordinator.cli", "worker", "--concurrency", "2"],
        SMOLTORRENT_DISCOVER="1",
    )
    wait_for(lambda: len(stack.cli_json("nodes", "ls")) == 4, "the worker to register 4 nodes")

    # 3. A checkpoint stored through them.
    source = tmp_path / "step_1.safetensors"
    write_checkpoint(source, 3_000_000, hidden=128)
    os.utime(source, (time.time() - 60, time.time() - 60))
    stack.cli("store", str(source))

    # 4. Node 0 comes back at another address (a DHCP lease changed while it was off).
    moved = next(node_id for node_id, i in ids.items() if i == 0)
    stack.stop("node0")
    new_address = stack.link.address("n0", 31, old=11)
    stack.start_node(0)

    def moved_there():
        nodes = {n["node_id"]: n for n in stack.cli_json("nodes", "ls")}
        return nodes if nodes[moved]["address"] == f"{new_address}:{NODE_PORT}" else None

    nodes = wait_for(moved_there, "the worker to move node 0 to its new address")
    assert len(nodes) == 4 and all(n["up"] for n in nodes.values())  # updated, not duplicated

    # 5. Its shards are still its own: every shard has both copies, and a gather works.
    (row,) = stack.cli_json("ls")
    assert row["min_copies"] == 2 and not row["under_replicated"]
    out = tmp_path / "back.safetensors"
    stack.cli("gather", "step_1.safetensors", "-o", str(out))
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(source.read_bytes()).digest()

    # 6. `discover --register` agrees: every node is known where it is.
    again = stack.cli_json("discover", "--register", "--timeout", "3")
    assert sorted(r["outcome"] for r in again) == ["known"] * 4


def test_a_node_started_with_no_mdns_stays_quiet(stack: Stack, tmp_path: Path) -> None:
    stack.link.add("n0", 11)
    data = tmp_path / "quiet"
    command = [sys.executable, "-m", "coordinator.cli", "serve", "--data-dir", str(data)]
    command += ["--host", "0.0.0.0", "--no-mdns"]
    stack.spawn("quiet", f"st{stack.link.tag}n0", command)
    wait_for(lambda: (data / "port").exists(), "the node to listen")
    assert stack.cli_json("discover", "--timeout", "2") == []


def start_rogue(stack: Stack, member: str, host: int, node_id: str | None, key: str) -> str:
    """A real node in a namespace of its own that advertises itself over mDNS, started with
    `key` ("": none, --insecure) and, with node_id, claiming that id: what anyone on the
    link can run. Its address."""
    stack.link.add(member, host)
    address = f"{stack.link.subnet}.{host}"
    data = stack.root / member
    data.mkdir()
    if node_id is not None:
        (data / "node_id").write_text(node_id + "\n")
    command = [sys.executable, "-m", "worker_server", "--data-dir", str(data)]
    command += ["--host", "0.0.0.0", "--port", str(NODE_PORT)]
    command += [] if key else ["--insecure"]
    stack.spawn(member, f"st{stack.link.tag}{member}", command, SMOLTORRENT_CLUSTER_KEY=key)
    wait_for(lambda: (data / "port").exists(), f"{member} to listen")
    return address


def start_quiet_node(stack: Stack, key: str) -> tuple[str, str]:
    """The real node: no advert (so only an impostor advertises its id), registered by
    address as a user does. (node id, address)."""
    stack.link.add("n0", 11)
    data = stack.root / "real"
    command = [sys.executable, "-m", "worker_server", "--data-dir", str(data), "--no-mdns"]
    command += ["--host", "0.0.0.0", "--port", str(NODE_PORT)]
    command += [] if key else ["--insecure"]
    stack.spawn("real", f"st{stack.link.tag}n0", command, SMOLTORRENT_CLUSTER_KEY=key)
    wait_for(lambda: (data / "port").exists(), "the real node to listen")
    address = f"{stack.link.subnet}.11:{NODE_PORT}"
    cli(stack, key, "nodes", "add", address)
    return (data / "node_id").read_text().strip(), address


def cli(stack: Stack, key: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
    saved = stack.env
    stack.env = dict(saved, SMOLTORRENT_CLUSTER_KEY=key)
    try:
        return stack.cli(*argv, check=check)
    finally:
        stack.env = saved


def registered(stack: Stack, key: str) -> dict[str, str]:
    rows = json.loads(cli(stack, key, "nodes", "ls", "--json").stdout)
    return {row["node_id"]: row["address"] for row in rows}


def worker_log(stack: Stack) -> str:
    return (stack.root / "worker.log").read_text(errors="replace")


def test_unkeyed_discovery_registers_nothing_and_an_advert_cannot_move_a_node(
    stack: Stack,
) -> None:
    """Issue 22: with no cluster key, SMOLTORRENT_DISCOVER=1 registered any advertiser,
    and one that claimed a registered node's id moved that node to its own address."""
    real_id, real_address = start_quiet_node(stack, "")
    impostor = start_rogue(stack, "n1", 12, real_id, "")
    stranger = start_rogue(stack, "n2", 13, None, "")
    stranger_id = (stack.root / "n2" / "node_id").read_text().strip()

    stack.spawn(
        "worker",
        stack.client,
        [sys.executable, "-m", "coordinator.cli", "worker", "--concurrency", "1"],
        SMOLTORRENT_DISCOVER="1",
        SMOLTORRENT_CLUSTER_KEY="",
    )

    def decided() -> bool:
        # The worker says why it registers neither; on a build that registers them, the
        # registry changes instead.
        seen = worker_log(stack)
        said = all(
            f"{n[:12]} at {a}" in seen for n, a in [(real_id, impostor), (stranger_id, stranger)]
        )
        return said or registered(stack, "") != {real_id: real_address}

    wait_for(decided, "the worker to decide about both adverts")
    assert registered(stack, "") == {real_id: real_address}
    assert "no cluster key" in worker_log(stack)

    # `discover` still lists what answered; `--register` without a key is refused.
    listed = json.loads(cli(stack, "", "discover", "--json", "--timeout", "2").stdout)
    seen = {f["node_id"]: f["address"] for f in listed}
    assert seen.get(stranger_id) == f"{stranger}:{NODE_PORT}"
    refused = cli(stack, "", "discover", "--register", "--timeout", "1", check=False)
    assert refused.returncode == 2
    assert "cluster key" in refused.stderr and "nodes add" in refused.stderr
    assert registered(stack, "") == {real_id: real_address}


def test_keyed_discovery_registers_only_a_node_that_proves_the_key(stack: Stack) -> None:
    """With the key, an advertiser that does not hold it (none, or another) is never
    registered, and one claiming a registered node's id does not move it."""
    real_id, real_address = start_quiet_node(stack, KEY)
    impostor = start_rogue(stack, "n1", 12, real_id, "")
    wrong_key = start_rogue(stack, "n2", 13, None, "not-the-cluster-key")
    wrong_id = (stack.root / "n2" / "node_id").read_text().strip()
    member = start_rogue(stack, "n3", 14, None, KEY)
    member_id = (stack.root / "n3" / "node_id").read_text().strip()

    stack.spawn(
        "worker",
        stack.client,
        [sys.executable, "-m", "coordinator.cli", "worker", "--concurrency", "1"],
        SMOLTORRENT_DISCOVER="1",
    )

    def decided() -> bool:
        seen = worker_log(stack)
        refused = all(f"{a}:{NODE_PORT}" in seen for a in (impostor, wrong_key))
        return refused and member_id in registered(stack, KEY)

    wait_for(decided, "the worker to register the member and refuse both impostors")
    assert registered(stack, KEY) == {real_id: real_address, member_id: f"{member}:{NODE_PORT}"}
    assert wrong_id not in registered(stack, KEY)


def test_a_relay_advertising_a_registered_node_does_not_move_it(tmp_path: Path) -> None:
    """A keyless relay on the LAN that advertises a registered node's id at its own
    address, and forwards every connection to the node, passes the keyed handshake (the
    node answers it through the relay). While the node still answers at its registered
    address, it is not moved: the relay would carry, and could drop, all its traffic.
    Once that address is silent (the node really moved), the same advert moves it."""
    key = KEY.encode()
    pid, port = start_redis(tmp_path / "redis")
    node = start_node(tmp_path / "node", key)
    relay = start_proxy(str(node.address), tmp_path / "relay")
    try:
        md = Metadata(url_for(tmp_path / "redis", port))
        node_id = node.client().stat().node_id
        md.nodes.add_node(node_id, node.address)
        advert = Found(node_id, ("127.0.0.1",), relay.port, 3, None, node_id)
        with pytest.raises(SmoltorrentError, match="still answers"):
            register(md, advert, key)
        assert md.nodes.nodes()[node_id].address == node.address
        # The node moves for real: its old address goes silent, the advert stands.
        md.nodes.add_node(node_id, NodeAddress("127.0.0.1", free_port()))
        assert register(md, advert, key) == ("moved", NodeAddress("127.0.0.1", relay.port))
    finally:
        relay.stop()
        node.kill()
        os.kill(pid, signal.SIGTERM)
