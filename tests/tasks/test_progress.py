"""The store progress bar moves with bytes as they are sent, not a whole shard at a time,
for copies sent from the coordinator and for chains alike; on a terminal only: a pipe gets
one summary line, --json only JSON."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint
from tests.tasks.test_control_plane import make_blobs_ckpt
from tests.tcpproxy import start_proxy

# bytes/s each node's link forwards: a 20 MB shard takes ~5 s, well past what the kernel's
# socket buffers take at once (a few MB: that much shows as sent at the first update)
RATE_BPS = 4_000_000
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_on_a_terminal(
    argv: list[str], env: dict[str, str], timeout: float = 180, columns: int = 150
) -> str:
    """What a user's terminal shows while `argv` runs (a pseudo-terminal: rich draws bars)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv, env={**env, "TERM": "xterm", "COLUMNS": str(columns)}, stdout=slave, stderr=slave
    )
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    # poll, not select: a pytest worker that has run hundreds of cluster tests can hold a
    # descriptor numbered past select's limit of 1024
    poller = select.poll()
    poller.register(master, select.POLLIN)
    while time.monotonic() < deadline:
        if poller.poll(200):
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(10) == 0, out.decode(errors="replace")[-3000:]
    return ANSI.sub("", out.decode(errors="replace"))


def slow_links(cluster, tmp_path: Path) -> list:
    """A throttling proxy in front of every node, registered as that node's address: every
    put, and every chain hop between nodes, crosses a slow link."""
    proxies = [start_proxy(str(n.address), tmp_path, rate=RATE_BPS) for n in cluster.node_procs]
    cluster.cli("nodes", "add", *(f"127.0.0.1:{p.port}" for p in proxies))
    return proxies


def bar_readings(screen: str) -> set[tuple[float, float]]:
    """(done, total) in MB of every state of the store bar the terminal showed."""
    return {(float(a), float(b)) for a, b in re.findall(r"(\d+\.\d)/(\d+\.\d) MB", screen)}


def test_store_bar_moves_with_bytes_and_stays_off_in_pipes(make_cluster, tmp_path: Path) -> None:
    # Copies sent from the coordinator, one transfer per replica.
    cluster = make_cluster(nodes=2, SMOLTORRENT_CHAIN="0")
    proxies = slow_links(cluster, tmp_path)
    try:
        source = tmp_path / "slow.safetensors"
        write_checkpoint(source, 40_000_000, hidden=512)
        os.utime(source, (time.time() - 60, time.time() - 60))
        cli = [sys.executable, "-m", "coordinator.cli"]

        screen = run_on_a_terminal([*cli, "store", str(source)], cluster.env(), columns=120)
        fractions = bar_readings(screen)
        partial = sorted(a for a, b in fractions if 0 < a < b)
        # Two shards x two copies: whole shards alone would show only 0, 1/2 and the total.
        assert len(partial) >= 2, screen[-3000:]
        # The file's bytes from the first frame (not 0/1 bytes, not both copies' wire bytes),
        # chunks as the summary counts them, no "?" before a speed, each frame one line.
        size = f"{source.stat().st_size / 1e6:.1f}"
        totals = {b for _, b in fractions}
        assert totals == {float(size)} and partial[-1] < float(size), sorted(fractions)
        frames = [f for f in re.split(r"[\r\n]", screen) if "storing slow" in f]
        assert frames and all(f"/{size} MB" in f for f in frames), frames
        assert re.search(r" \d+/(\d+) chunks ━", frames[-1]), frames  # the count once known
        assert not any(re.search(r"raw|shards", f) for f in frames), frames
        assert not re.search(r"/1 bytes|\s\?\s|-:--:--", screen), screen[-3000:]
        assert "stored: slow.safetensors" in screen and "MB/s" in screen
        assert re.search(r"in \d+ chunks x 2 replicas", screen), screen[-3000:]

        # In a pipe: no bar, one summary line with the time and the rate.
        rewritten = tmp_path / "again.safetensors"
        write_checkpoint(rewritten, 1_000_000, hidden=64)
        os.utime(rewritten, (time.time() - 60, time.time() - 60))
        piped = cluster.cli("store", str(rewritten))
        lines = piped.stdout.strip().splitlines()
        assert len(lines) == 1 and re.search(r" s \([\d.]+ [kMG]?B/s\)$", lines[0]), lines
        assert "\r" not in piped.stdout + piped.stderr and "━" not in piped.stdout + piped.stderr

        # Under --json, on a terminal too: JSON only.
        back = tmp_path / "back.safetensors"
        gather = [*cli, "gather", "slow.safetensors", "-o", str(back), "--json"]
        as_json = run_on_a_terminal(gather, cluster.env())
        assert json.loads(as_json)["name"] == "slow.safetensors"
    finally:
        for proxy in proxies:
            proxy.stop()


def test_chain_store_bar_moves_inside_a_shard(make_cluster, tmp_path: Path) -> None:
    # R=2 on 3 nodes: one chain task per shard (the default), each chain head passing the
    # bytes on to the next node as they arrive.
    cluster = make_cluster(nodes=3)
    proxies = slow_links(cluster, tmp_path)
    try:
        # Three 12 MiB blobs: sums of whole blobs are far apart, in chunks as in shards
        # (many small chunks would leave no reading between two of their sums).
        source = make_blobs_ckpt(tmp_path / "chained.safetensors", 3, 12 << 20)
        screen = run_on_a_terminal(
            [sys.executable, "-m", "coordinator.cli", "store", str(source)], cluster.env()
        )
        assert "stored: chained.safetensors" in screen, screen[-3000:]
        attempts = cluster.md.transfers.attempts(only_vkey(cluster))
        assert attempts and all(a.get("chain") for a in attempts), attempts

        # Where a bar counting whole shards could stand: any sum of settled copies (each
        # copy half its chunk's bytes of the file).
        manifest = cluster.md.versions.manifest(only_vkey(cluster))
        sizes = [(s.data_end - s.data_start) / 2e6 for s in manifest.entries for _ in range(2)]
        whole = {0.0}
        for size in sizes:
            whole |= {w + size for w in whole}
        readings = bar_readings(screen)
        inside = sorted(a for a, _ in readings if all(abs(a - w) > 0.15 for w in whole))
        assert len(inside) >= 2, (sorted(readings), sorted(whole))
    finally:
        for proxy in proxies:
            proxy.stop()


def only_vkey(cluster) -> str:
    (vkey,) = [
        v for name in cluster.md.versions.names() for v in cluster.md.versions.versions(name)
    ]
    return vkey
