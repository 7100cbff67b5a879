"""The retention sweep on a real cluster: keep the last K committed versions per name,
never the one a gather is reading."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from coordinator.dataplane.node_client import NodeClient
from coordinator.state.versions import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tcpproxy import start_proxy

NAME = "latest.safetensors"
READ_BPS = 64 * 1024  # bytes/s the nodes answer at under slow_reads: a gather takes ~4 s
KEEP = 3
# No periodic pass unless a test starts `smoltorrent beat`: the tests send the sweep.
ENV = {"SMOLTORRENT_KEEP_LAST": str(KEEP), "SMOLTORRENT_RETENTION_INTERVAL_S": "1"}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save_version(c, tmp_path: Path, step: int) -> tuple[str, Path]:
    """Store step `step` of NAME: a frozen tensor shared by every step (one blob for all
    of them) and a trained one unique to it; its vkey and source file."""
    path = tmp_path / f"step{step}.safetensors"
    rng = np.random.default_rng(step)
    save_file(
        {
            "a_frozen": np.arange(64 * 1024, dtype=np.float32),
            "b_trained": rng.standard_normal(64 * 1024).astype(np.float32),
        },
        str(path),
    )
    past = time.time() - 60  # settled: the store does not wait for the file
    os.utime(path, (past, past))
    c.cli("store", str(path), "--name", NAME, "--shards", "2")
    vkey = c.md.versions.current(NAME)
    assert c.md.versions.state(vkey) == COMMITTED
    return vkey, path


def blobs(c, vkey: str) -> list[str]:
    return [s.blob_sha256 for s in c.md.versions.manifest(vkey).entries]


def on_nodes(c) -> tuple[set[str], set[str]]:
    """(every blob, every manifest key) the nodes hold."""
    held, manifests = set(), set()
    for n in c.node_procs:
        held |= set(NodeClient(n.address).list_blobs())
        manifests |= set(NodeClient(n.address).list_manifests())
    return held, manifests


def removed(c, vkey: str) -> bool:
    return c.md.r.hget(f"smoltorrent:version:{vkey}", "state") in (None, "removed")


def gather(c, vkey: str, out: Path) -> subprocess.Popen:
    version_id = c.md.versions.version(vkey)["version_id"]
    return subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "gather", NAME, "--version", version_id]
        + ["-o", str(out), "--json"],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def beat_process(tmp_path):
    """`smoltorrent beat` for a cluster, stopped at the end of the test."""
    procs = []

    def start(c) -> None:
        log = open(tmp_path / f"beat{len(procs)}.log", "ab")  # noqa: SIM115  (closed at the end)
        command = [sys.executable, "-m", "coordinator.cli", "beat", "--loglevel", "INFO"]
        procs.append((subprocess.Popen(command, env=c.env(), stdout=log, stderr=log), log))

    yield start
    for proc, _ in procs:
        proc.terminate()
    for proc, log in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            # A beat was seen (CI, 2026-11-25) to go on sending for minutes after its
            # SIGTERM; why is not known yet. What the tests check is done by then.
            proc.kill()
            proc.wait(timeout=20)
        log.close()


@pytest.fixture
def slow_reads(tmp_path):
    """Route every node of a cluster through a proxy that sends answers at READ_BPS, so a
    gather holds its reader mark for seconds (what the nodes receive is not slowed)."""
    proxies = []

    def route(c) -> None:
        for n in c.node_procs:
            proxies.append(start_proxy(str(n.address), tmp_path / "proxies", reply_rate=READ_BPS))
        c.cli("nodes", "add", *(f"127.0.0.1:{p.port}" for p in proxies[-len(c.node_procs) :]))

    yield route
    for proxy in proxies:
        proxy.stop()


@contextlib.contextmanager
def frozen_reader(c, vkey: str):
    """Wait for the gather of `vkey` to take its reader mark, then freeze the worker
    process running it (SIGSTOP) until the block ends: a gather as slow as the test
    needs, with no timing involved."""
    marks = wait_until(lambda: c.md.removals.readers(vkey), timeout=60, what="the reader mark")
    pid = int(marks[0].split(":")[1])  # host:pid:task id
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def sweep(c) -> dict:
    from celery import Celery

    app = Celery(broker=c.redis_url, backend=c.redis_url)
    try:
        return app.send_task("smoltorrent.sweep.retention", queue="control").get(timeout=60)
    finally:
        app.close()


def finished(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"gather failed:\n{out}\n{err}"
    return out


def test_retention_keeps_exactly_k_after_k_plus_3_stores(make_cluster, beat_process, tmp_path):
    c = make_cluster(3, **ENV)
    stored = [save_version(c, tmp_path, step) for step in range(KEEP + 3)]
    vkeys = [v for v, _ in stored]
    shared = blobs(c, vkeys[0])[0]
    assert all(blobs(c, v)[0] == shared for v in vkeys)  # the frozen tensor: one blob
    unique = {v: blobs(c, v)[1] for v in vkeys}
    beat_process(c)
    wait_until(lambda: all(removed(c, v) for v in vkeys[:3]), timeout=90, what="the removes")
    assert c.md.versions.versions(NAME) == vkeys[3:]
    assert all(c.md.versions.state(v) == COMMITTED for v in vkeys[3:])
    assert c.md.versions.current(NAME) == vkeys[-1]
    held, manifests = on_nodes(c)
    # The shared blob stays with its two copies; the old versions' own blobs and their
    # manifests are gone from every node; the kept ones are all there.
    assert shared in held and len(c.md.blobs.placement(shared)) == 2
    assert not {unique[v] for v in vkeys[:3]} & held
    assert {unique[v] for v in vkeys[3:]} <= held
    assert not set(vkeys[:3]) & manifests and set(vkeys[3:]) <= manifests
    for vkey, path in stored[3:]:
        out = tmp_path / f"out-{vkey[:8]}.safetensors"
        finished(gather(c, vkey, out))
        assert sha(out) == sha(path)
    # The beat keeps running (a pass a second): one more pass removes nothing (or stands
    # down while the beat's own pass holds the lock).
    assert sweep(c).get("retired", 0) == 0
    assert c.md.versions.versions(NAME) == vkeys[3:]


def test_a_gather_of_the_oldest_kept_version_survives_the_sweep(make_cluster, slow_reads, tmp_path):
    c = make_cluster(3, **ENV)
    stored = [save_version(c, tmp_path, step) for step in range(KEEP + 3)]
    slow_reads(c)
    vkeys = [v for v, _ in stored]
    oldest_kept, path = stored[3]
    out = tmp_path / "oldest.safetensors"
    proc = gather(c, oldest_kept, out)
    with frozen_reader(c, oldest_kept):
        # Mid-gather: the sweep removes the three older versions, blobs and manifests.
        assert sweep(c) == {"retired": 3}
        wait_until(lambda: all(removed(c, v) for v in vkeys[:3]), timeout=60, what="removes")
    finished(proc)
    assert sha(out) == sha(path)
    assert c.md.removals.readers(oldest_kept) == []  # the gather took its mark away


def test_a_slow_gather_blocks_the_removal_of_its_version_until_it_ends(
    make_cluster, slow_reads, tmp_path
):
    c = make_cluster(3, **ENV)
    stored = [save_version(c, tmp_path, step) for step in range(KEEP)]
    slow_reads(c)
    first, path = stored[0]
    out = tmp_path / "first.safetensors"
    proc = gather(c, first, out)
    with frozen_reader(c, first):
        save_version(c, tmp_path, KEEP)  # `first` is past K now, and still being read
        assert sweep(c) == {"reading": 1}
        assert sweep(c) == {"reading": 1}
        assert c.md.versions.state(first) == COMMITTED
    finished(proc)
    assert sha(out) == sha(path)
    assert sweep(c) == {"retired": 1}
    wait_until(lambda: removed(c, first), timeout=60, what="the remove")
    assert len(c.md.versions.versions(NAME)) == KEEP


@pytest.mark.parametrize(
    "setting",
    [
        "SMOLTORRENT_KEEP_LAST=0",
        "SMOLTORRENT_RETENTION_INTERVAL_S=soon",
        "SMOLTORRENT_CROSSCHECK_INTERVAL_S=0",
        "SMOLTORRENT_ORPHAN_GRACE_S=-1",
    ],
)
def test_a_bad_retention_or_crosscheck_setting_is_one_line_and_exit_2(tmp_path, setting):
    from tests.coordinator.cli.test_papercuts import clean_env, one_line_error, run

    name, value = setting.split("=")
    result = run("beat", env=clean_env(tmp_path, **{name: value}))
    assert result.returncode == 2
    assert name in one_line_error(result)
