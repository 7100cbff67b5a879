"""`smoltorrent demo`: a whole cluster on this machine, end to end, then torn down.

Redis, 4 shard servers and a Celery worker start as real processes; a
checkpoint is stored at R=2, one node is killed with SIGKILL, and the
checkpoint is gathered back and compared by SHA-256. Then beat runs the sweeps
(on intervals of a second here) until the dead node's shards are back at two
copies on the three others, with nobody asking.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.local.cluster import LocalCluster
from coordinator.local.synthetic import write_checkpoint
from coordinator.state.metadata import Metadata
from smoltorrent.errors import SmoltorrentError


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def run_demo(
    run_command: Callable[[list[str]], int],
    *,
    checkpoint: str | None = None,
    size_mb: int,
    keep: bool = False,
    quiet: bool = False,
    say: Callable[[str], None] = lambda _: None,
) -> dict:
    """Run the scenario through `run_command` (the command line's own entry point, passed
    in so this module never imports the CLI) and return its report."""
    root = Path(tempfile.mkdtemp(prefix="smoltorrent-demo-"))
    cluster = LocalCluster(root, nodes=4, host_id=f"demo-{os.getpid()}", extra_env=DEMO_SWEEPS)
    timings: dict[str, float] = {}

    def step(label: str, fn):
        t = time.monotonic()
        out = fn()
        timings[label] = time.monotonic() - t
        return out

    try:
        say(f"smoltorrent demo in {root}")
        if checkpoint:
            source = Path(checkpoint).resolve()
        else:
            source = root / "demo-model.safetensors"
            step("build checkpoint", lambda: write_checkpoint(source, size_mb * 1_000_000))
        step("start cluster", lambda: cluster.start(worker=False))
        # Every in-process command from here on talks to this cluster's Redis.
        os.environ.update({k: v for k, v in cluster.env().items() if k.startswith("SMOLTORRENT")})
        step("start worker", cluster.start_worker)
        say(
            f"cluster up: redis :{cluster.redis_port}, nodes "
            + ", ".join(str(n.address) for n in cluster.node_procs)
            + ", 1 Celery worker"
        )
        size = source.stat().st_size
        say(f"checkpoint: {source.name}, {size / 1e6:.1f} MB")

        json_flag = ["--json"] if quiet else []
        _run(
            step,
            "register nodes",
            run_command,
            ["nodes", "add", *(str(n.address) for n in cluster.node_procs), *json_flag],
        )
        _run(step, "store", run_command, ["store", str(source), "--replicas", "2", *json_flag])
        victim = random.Random(size).randrange(len(cluster.node_procs))
        cluster.node_procs[victim].kill()
        say(f"killed node {victim} ({cluster.node_procs[victim].address}) with SIGKILL")
        out = root / "gathered.safetensors"
        _run(step, "gather", run_command, ["gather", source.name, "-o", str(out), *json_flag])
        cluster.start_beat()
        say("beat started: the sweeps find the dead node and copy its shards node to node")
        step("self-heal", lambda: _wait_for_r(cluster, source.name, victim))
        say("every shard is back at 2 copies on the live nodes")
        return {
            "checkpoint_bytes": size,
            "killed_node": str(cluster.node_procs[victim].address),
            "byte_identical": _sha256(source) == _sha256(out),
            "re_replicated": True,
            "seconds": {k: round(v, 3) for k, v in timings.items()},
            "store_mb_s": round(size / 1e6 / timings["store"], 1),
            "gather_mb_s": round(size / 1e6 / timings["gather"], 1),
        }
    finally:
        cluster.stop()
        if keep:
            say(f"cluster files kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


# Sweeps on a demo's time scale (the defaults are minutes: docs/self-healing.md's table).
DEMO_SWEEPS = {
    "SMOLTORRENT_HEALTH_INTERVAL_S": "1",
    "SMOLTORRENT_DEAD_AFTER_S": "3",
    "SMOLTORRENT_REPAIR_INTERVAL_S": "1",
}
DEMO_HEAL_TIMEOUT_S = 120  # seconds; a 50 MB demo heals in well under 20


def _wait_for_r(cluster: LocalCluster, name: str, victim: int) -> None:
    """Until every shard of `name` has two copies on nodes other than the killed one."""
    md = Metadata(cluster.redis_url)
    dead = str(cluster.node_procs[victim].address)
    live = {n for n, rec in md.nodes.nodes().items() if str(rec.address) != dead}
    manifest = md.versions.manifest(md.versions.current(name))
    deadline = time.monotonic() + DEMO_HEAL_TIMEOUT_S
    while any(len(md.blobs.placement(s.blob_sha256) & live) < 2 for s in manifest.entries):
        if time.monotonic() > deadline:
            raise SmoltorrentError(
                f"the sweeps did not bring every shard back to 2 copies in {DEMO_HEAL_TIMEOUT_S}"
                f" s; see {cluster.root / 'beat.log'} and {cluster.root / 'worker.log'}"
            )
        time.sleep(0.2)


def _run(step, label: str, run_command, argv: list[str]) -> None:
    # With --json the sub-commands' own JSON is swallowed: one document on stdout.
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink) if "--json" in argv else contextlib.nullcontext():
        code = step(label, lambda: run_command(argv))
    if code != 0:
        raise SmoltorrentError(f"demo step '{label}' failed (exit {code}); see the message above")
