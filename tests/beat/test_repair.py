"""The repair sweep on a real cluster: `smoltorrent beat` with second-long intervals,
a real worker, real node processes killed with SIGKILL and started again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from coordinator.dataplane.store_engine import prepare_store, store_checkpoint
from coordinator.state import redis_keys as K
from coordinator.state.liveness import DEAD, node_health
from coordinator.state.versions import COMMITTED
from smoltorrent import defaults
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_blobs_ckpt, make_ckpt, sha
from tests.tcpproxy import start_proxy

FAST = {
    "SMOLTORRENT_HEALTH_INTERVAL_S": "1",
    "SMOLTORRENT_DEAD_AFTER_S": "3",
    "SMOLTORRENT_REPAIR_INTERVAL_S": "1",
}


def stored(c, src, name: str) -> list[str]:
    """Store src at R=2 through the CLI; the blob digests of the committed version."""
    c.cli("store", str(src), "--name", name)
    md = c.md
    vkey = md.versions.current(name)
    assert md.versions.version(vkey)["state"] == COMMITTED
    return [s.blob_sha256 for s in md.versions.manifest(vkey).entries]


def holder_of(c, digest: str):
    """The node process holding a copy of `digest` that is first in the cluster's order."""
    holders = c.md.blobs.placement(digest)
    return next(n for n in c.node_procs if n.client().ping() in holders)


def copies_on_disk(nodes) -> Counter:
    """Digest -> how many of `nodes` hold it, asked of the nodes themselves."""
    held: Counter = Counter()
    for n in nodes:
        held.update(list(n.client().list_blobs()))
    return held


def at_r_on(c, digests, nodes, r: int = 2) -> bool:
    """Every blob has r copies on `nodes`, in the placement and on their disks."""
    ids = {n.client().ping() for n in nodes}
    on_disk = copies_on_disk(nodes)
    md = c.md
    return all(len(md.blobs.placement(d) & ids) >= r and on_disk[d] >= r for d in digests)


def test_a_dead_node_is_re_replicated_and_a_second_death_loses_nothing(
    make_cluster, beat, tmp_path
):
    c = make_cluster(4, **FAST)
    src = make_ckpt(tmp_path / "big.safetensors", size=8_000_000)
    digests = stored(c, src, "big.safetensors")
    # The node that dies holds a blob (a small checkpoint is one chunk on R of the nodes).
    first = holder_of(c, digests[0])
    beat(c)
    first.kill()
    survivors = [n for n in c.node_procs if n is not first]
    wait_until(
        lambda: at_r_on(c, digests, survivors), timeout=120, what="R copies on the survivors"
    )
    # Exactly R on the survivors: no surplus copy, and none sent to a node holding one.
    on_disk = copies_on_disk(survivors)
    assert {d: on_disk[d] for d in digests} == {d: 2 for d in digests}
    status = c.cli_json("status")
    assert status["under_replicated"] == []
    assert status["repairs_done"]["repaired"] >= 1

    # Now a second node dies for good: every shard still has a copy somewhere.
    survivors[0].kill()
    out = tmp_path / "out.safetensors"
    c.cli("gather", "big.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_a_node_that_comes_back_is_readmitted_and_the_surplus_trimmed(make_cluster, beat, tmp_path):
    c = make_cluster(3, **FAST)
    src = make_ckpt(tmp_path / "back.safetensors", size=6_000_000)
    digests = stored(c, src, "back.safetensors")
    returning = holder_of(c, digests[0])
    returning_id = returning.client().ping()
    held_before = set(returning.client().list_blobs())
    assert held_before
    beat(c)
    returning.kill()
    others = [n for n in c.node_procs if n is not returning]
    wait_until(lambda: at_r_on(c, digests, others), timeout=120, what="R copies on the others")

    returning.start()
    wait_until(
        lambda: returning_id not in c.md.nodes.declared_dead(), timeout=60, what="re-admission"
    )

    def exactly_r() -> bool:
        on_disk = copies_on_disk(c.node_procs)
        return all(on_disk[d] == 2 and len(c.md.blobs.placement(d)) == 2 for d in digests)

    wait_until(exactly_r, timeout=120, what="the surplus copies trimmed")
    # The trim task counts its deletes after the last one is done: the copies can be
    # gone a moment before the count is (a loaded CI looked in between).
    wait_until(
        lambda: c.md.r.hget("smoltorrent:repairs:counts", "trimmed"),
        timeout=30,
        what="the trim counted",
    )
    out = tmp_path / "out.safetensors"
    c.cli("gather", "back.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_fewer_live_nodes_than_r_is_shown_as_unrepairable_not_retried(make_cluster, beat, tmp_path):
    c = make_cluster(2, **FAST)
    src = make_ckpt(tmp_path / "two.safetensors")
    digests = stored(c, src, "two.safetensors")
    beat(c)
    gone = c.node_procs[1]
    gone_id = gone.client().ping()
    gone.kill()
    wait_until(
        lambda: gone_id in c.md.nodes.declared_dead(), timeout=60, what="the node declared dead"
    )

    def listed():
        return c.cli_json("status")["unrepairable"]

    rows = wait_until(lambda: len(listed()) == len(set(digests)) and listed(), timeout=60)
    assert {r["digest"] for r in rows} == set(digests)
    assert all("live node" in r["reason"] and r["copies"] == 1 for r in rows)
    assert "live node(s) for 2 copies" in c.cli("status").stdout
    # Nothing was sent: there is no target, so no repair task runs, then fails, then runs.
    assert c.md.r.hlen("smoltorrent:repairs") == 0
    assert "smoltorrent.repair[" not in c.worker_log()

    gone.start()
    wait_until(lambda: not listed(), timeout=60, what="the list cleared once the node is back")


def pending_with_shard_0_placed(c, src):
    """A long store as it stands mid-way: every blob on its nodes, but only shard 0's
    transfers settled; shard 1's are still (as far as Redis knows) on their way."""
    md = c.md
    result = store_checkpoint(src, [n.address for n in c.node_procs], shards=2)
    manifest = result.manifest
    targets = [tuple(result.holders[i]) for i in range(len(manifest.entries))]
    identity = prepare_store(src, src.name, {n: 10**12 for n in md.nodes.nodes()}).identity
    vkey = manifest.storage_key()
    fields = {"path": str(src), "host": c.host_id, "identity": json.dumps(identity.to_dict())}
    assert md.versions.create_pending(manifest, vkey, fields, targets) == "created"
    for r, node in enumerate(targets[0]):
        assert md.transfers.settle(vkey, 0, r, node, manifest.entries[0].blob_sha256) is False
    return vkey, manifest, targets


def test_a_pending_versions_settled_shard_is_repaired_when_its_node_dies(
    make_cluster, beat, tmp_path
):
    """Shard 0 of a store still running is placed and settled (its transfers are done)
    when a node holding it dies: the store moves that shard no more, so the repair sweep
    brings it back to R while the version is still pending. Shard 1, still the store's,
    is left to its transfers."""
    # No reconcile pass while the test runs: it would re-drive shard 1 and commit.
    c = make_cluster(4, **FAST, SMOLTORRENT_RECONCILE_INTERVAL_S="3600")
    src = make_ckpt(tmp_path / "long.safetensors", size=6_000_000)
    vkey, manifest, targets = pending_with_shard_0_placed(c, src)
    placed = manifest.entries[0].blob_sha256
    by_id = {n.client().ping(): n for n in c.node_procs}
    lost = by_id[targets[0][0]]
    beat(c)
    lost.kill()
    survivors = [n for n in c.node_procs if n is not lost]
    wait_until(
        lambda: at_r_on(c, [placed], survivors), timeout=90, what="shard 0 at R on survivors"
    )
    assert c.md.versions.state(vkey) == "pending"
    assert copies_on_disk(survivors)[placed] == 2
    # Shard 1 is the store's: no repair touched it (it has no placement yet at all).
    assert c.md.blobs.placement(manifest.entries[1].blob_sha256) == set()


@pytest.fixture
def tiny_tmp():
    """tiny_tmp(node): a 4 KiB tmpfs over the node's tmp dir, where every blob it receives
    is written first: the node answers pings and says it has room, and every put fails."""
    mounted = []

    def mount(node) -> None:
        target = node.data_dir / "tmp"
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(target)], check=True)
        mounted.append(target)

    yield mount
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_target_that_keeps_failing_backs_off_and_status_says_until_when(
    make_cluster, beat, tiny_tmp, tmp_path
):
    """A dead node's shards must go to the one other node left, whose puts all fail: each
    copy fails once, then waits out its backoff (shown by status), instead of being sent
    again by every repair sweep."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    c = make_cluster(3, **FAST, SMOLTORRENT_REPAIR_BACKOFF_S="3600")
    src = make_ckpt(tmp_path / "fail.safetensors", size=6_000_000)
    digests = stored(c, src, "fail.safetensors")
    ids = {n: n.client().ping() for n in c.node_procs}
    # The two holders of the first blob: one dies, one stays. Its blobs, and any other
    # on exactly those two, can only be repaired onto the third node, whose puts fail.
    # (The nodes were taken in the cluster's order, and the test skipped when placement
    # put no blob on exactly the first and the third.)
    dying, holder = (n for n in c.node_procs if ids[n] in c.md.blobs.placement(digests[0]))
    (failing,) = set(c.node_procs) - {dying, holder}
    failing_id = ids[failing]
    stuck = {d for d in digests if c.md.blobs.placement(d) == {ids[dying], ids[holder]}}
    assert digests[0] in stuck
    tiny_tmp(failing)
    beat(c)
    dying.kill()

    def waiting() -> list[dict]:
        return [w for w in c.cli_json("status")["repairs_waiting"] if w["digest"] in stuck]

    rows = wait_until(lambda: len(waiting()) == len(stuck) and waiting(), timeout=90)
    assert {(w["digest"], w["target"]) for w in rows} == {(d, failing_id) for d in stuck}
    assert all(w["failures"] == 1 and w["until"] > time.time() + 1800 for w in rows)
    assert "last error" in c.cli("status").stdout

    # Several repair sweeps later, not one of those copies was sent again.
    runs = c.md.r.llen("smoltorrent:sweep:repair:runs")
    wait_until(
        lambda: c.md.r.llen("smoltorrent:sweep:repair:runs") >= min(runs + 5, 100),
        timeout=120,
        what="five more repair sweeps",
    )
    log = c.worker_log()
    for d in stuck:
        assert log.count(f"repair of {d} from") == 1, f"{d} was sent again before its backoff"
    assert all(w["failures"] == 1 for w in waiting())
    assert {d for d in stuck if len(c.md.blobs.placement(d) - {ids[dying]}) < 2} == stuck


def forget_alive(md, node_id: str) -> None:
    """A killed node's alive key deleted, as it lapses NODE_ALIVE_TTL_S (30 s) after its last
    answer: no beat here refreshes it. Waited for, it was 28 s of each test that kills a
    node; it is dead DEAD_AFTER_S after it was last seen either way (node_health)."""
    md.r.delete(K.NODE_ALIVE.format(node_id=node_id))


def run_sweep(c, name: str) -> dict:
    """One pass of a sweep, run by the cluster's worker now (no beat)."""
    from celery import Celery

    app = Celery(broker=c.redis_url, backend=c.redis_url)
    try:
        return app.send_task(f"smoltorrent.sweep.{name}", queue="control").get(timeout=120)
    finally:
        app.close()


def stored_with_a_surplus_copy(c, src) -> tuple[str, dict]:
    """`src` stored as "old" in one shard at R=2 on a 3-node cluster, then copied to the
    third node and counted there, as when a dead node comes back: a surplus the repair
    sweep trims. Returns the blob and the nodes by id."""
    c.cli("store", str(src), "--name", "old", "--shards", "1")
    (blob,) = [s.blob_sha256 for s in c.md.versions.manifest(c.md.versions.current("old")).entries]
    ids = {n.client().ping(): n for n in c.node_procs}
    holder = ids[min(c.md.blobs.placement(blob))]
    (back_id,) = set(ids) - c.md.blobs.placement(blob)
    holder.client().replicate(blob, ids[back_id].address)
    c.md.blobs.add_placement(blob, back_id)
    return blob, ids


def test_a_trim_in_flight_never_leaves_a_new_store_of_the_blob_short(make_cluster, tmp_path):
    """A blob has a surplus copy (3 copies at R=2: a dead node came back) and its trim is
    on its way when a new store of the same bytes at R=3 settles on all three copies. The
    trim must not leave the new version with fewer than 3. The trim is held mid-way, as
    it re-hashes the copies it keeps, by freezing every node's link (SIGSTOP on the
    proxies the nodes are registered through) until the new store has settled. The new
    store re-hashes the copies it counts too (invariant 14), so once the trim is held the
    nodes are registered again at their own addresses: the store reaches them, the
    trim's connection stays frozen in the stopped proxy."""
    c = make_cluster(3, SMOLTORRENT_SOCKET_TIMEOUT_S="300")
    src = make_ckpt(tmp_path / "shared.safetensors")
    blob, ids = stored_with_a_surplus_copy(c, src)
    proxies = [start_proxy(str(n.address), tmp_path / "proxies") for n in c.node_procs]
    store = None
    # One outer finally: a failure while the proxies are held still stops them (and the
    # store), instead of leaving their processes behind the test.
    try:
        try:
            c.cli("nodes", "add", *(f"127.0.0.1:{p.port}" for p in proxies))
            run_sweep(c, "health")  # fresh liveness through the proxies
            for p in proxies:
                os.kill(p.process.pid, signal.SIGSTOP)
            assert run_sweep(c, "repair")["trims"] == 1
            wait_until(lambda: f"smoltorrent.trim[trim-{blob}]" in c.worker_log(), 60, what="trim")
            wait_until(lambda: any(connected_to(p.port) for p in proxies), 60, what="trim held")
            c.cli("nodes", "add", *(str(n.address) for n in c.node_procs))
            store = subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "store", str(src), "--name", "new"]
                + ["--replicas", "3", "--shards", "1"],
                env=c.env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            vkey = wait_until(
                lambda: next(iter(c.md.versions.versions("new")), None), 60, what="new"
            )
            wait_until(
                lambda: c.md.transfers.barrier_complete(vkey), 60, what="the new store settled"
            )
            assert [s.blob_sha256 for s in c.md.versions.manifest(vkey).entries] == [blob]
        finally:
            for p in proxies:
                os.kill(p.process.pid, signal.SIGCONT)
        assert store.wait(timeout=300) == 0, store.stdout.read()
        wait_until(lambda: c.md.r.hlen("smoltorrent:repairs") == 0, 120, what="the trim done")
        assert c.md.versions.state(vkey) == COMMITTED
        assert len(c.md.blobs.placement(blob)) == 3
        assert copies_on_disk(c.node_procs)[blob] == 3
    finally:
        if store is not None and store.poll() is None:
            store.kill()
            store.wait()
        for p in proxies:
            p.stop()


def connected_to(port: int) -> bool:
    """Whether a client holds an open TCP connection to 127.0.0.1:`port` (the kernel
    accepts it into the backlog even while the process listening there is stopped)."""
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return bool(out.strip())


def test_a_store_created_while_a_trim_deletes_its_copy_ends_with_every_copy_on_disk(
    make_cluster, tmp_path
):
    """The trim of a surplus copy is held at its delete (only the link of the node whose
    copy it deletes is frozen: SIGSTOP on that node's proxy, the last holder by free space
    then node id, as trim_blob orders them). A store of the same bytes at R=3 created in
    that moment must end committed with 3 copies really on the nodes' disks: the trimmed
    copy is sent again once the delete is done, never counted while it is being deleted."""
    c = make_cluster(3, SMOLTORRENT_SOCKET_TIMEOUT_S="300")
    src = make_ckpt(tmp_path / "shared.safetensors")
    blob, ids = stored_with_a_surplus_copy(c, src)
    proxies = {n: start_proxy(str(p.address), tmp_path / "proxies") for n, p in ids.items()}
    try:
        c.cli("nodes", "add", *(f"127.0.0.1:{p.port}" for p in proxies.values()))
        run_sweep(c, "health")  # fresh liveness through the proxies
        up = c.md.nodes.alive(c.md.nodes.nodes())
        trimmed = sorted(ids, key=lambda n: (-int(up[n].get("free_bytes", 0)), n))[-1]
        frozen = proxies[trimmed]
        os.kill(frozen.process.pid, signal.SIGSTOP)
        assert run_sweep(c, "repair")["trims"] == 1
        # The trim kept the two others (re-hashed through their live links) and now waits
        # on its delete: the one connection ever opened to the frozen node's proxy.
        wait_until(lambda: connected_to(frozen.port), 120, what="the trim at its delete")
        store = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "store", str(src), "--name", "new"]
            + ["--replicas", "3", "--shards", "1"],
            env=c.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        vkey = wait_until(lambda: next(iter(c.md.versions.versions("new")), None), 60, what="new")

        def chain_ran() -> bool:
            retried = any(
                f"smoltorrent.chain[chain-{vkey}-" in line and " retry" in line
                for line in c.worker_log().splitlines()
            )
            return retried or c.md.transfers.barrier_complete(vkey)

        # Its chain task has run once (settled, or is waiting for the delete) before the
        # delete goes through.
        wait_until(chain_ran, 120, what="the new store's chain to run once")
    finally:
        for p in proxies.values():
            os.kill(p.process.pid, signal.SIGCONT)
    try:
        assert store.wait(timeout=300) == 0, store.stdout.read()
        wait_until(lambda: c.md.r.hlen("smoltorrent:repairs") == 0, 120, what="the trim done")
        assert c.md.versions.state(vkey) == COMMITTED
        assert copies_on_disk(c.node_procs)[blob] == 3
        assert c.md.blobs.placement(blob) == set(ids)
        assert c.md.r.hget("smoltorrent:repairs:counts", "trimmed") == "1"
    finally:
        for p in proxies.values():
            p.stop()


SWEEP_RUNS = "smoltorrent:sweep:repair:runs"
# Only the dead timeout and the health probe are shortened: the repair sweep keeps its
# default interval (30 s), so a test of how fast redundancy comes back sees what a user sees.
DEAD_SOON = {"SMOLTORRENT_HEALTH_INTERVAL_S": "2", "SMOLTORRENT_DEAD_AFTER_S": "5"}


def test_a_lost_nodes_blobs_are_all_back_at_r_within_one_or_two_repair_sweeps(
    make_cluster, beat, tmp_path
):
    """Invariant 13: a node holding dozens of blobs dies for good, and every blob is back at R
    while the repair sweep (default interval) has run at most twice: each copy that ends
    starts the next, the sweep only begins the drain and backs it up."""
    c = make_cluster(4, **DEAD_SOON)
    src = make_blobs_ckpt(tmp_path / "many.safetensors", 64)
    digests = stored(c, src, "many.safetensors")
    by_id = {n.client().ping(): n for n in c.node_procs}
    held = {i: [d for d in digests if i in c.md.blobs.placement(d)] for i in by_id}
    dead_id = max(sorted(held), key=lambda i: len(held[i]))
    assert len(held[dead_id]) >= 24
    beat(c)
    runs_before = c.md.r.llen(SWEEP_RUNS)
    by_id[dead_id].kill()
    survivors = [n for n in c.node_procs if n is not by_id[dead_id]]

    def sweeps() -> int:
        return c.md.r.llen(SWEEP_RUNS) - runs_before

    # Waits for the drain, or for a third sweep, which would mean the sweep sets the pace.
    wait_until(
        lambda: at_r_on(c, digests, survivors) or sweeps() > 2,
        timeout=600,
        what="R copies on the survivors or a third repair sweep",
    )
    short = [d for d in digests if len(c.md.blobs.placement(d) - {dead_id}) < 2]
    assert not short, f"after {sweeps()} repair sweeps, {len(short)} blobs are below R"
    assert sweeps() <= 2
    on_disk = copies_on_disk(survivors)
    assert {d: on_disk[d] for d in digests} == {d: 2 for d in digests}


def test_a_node_declared_dead_starts_its_repair_without_waiting_for_the_repair_sweep(
    make_cluster, beat, tmp_path
):
    """Invariant 13: the copies of a node declared dead start then, not at the next repair
    sweep. The sweep is set an hour apart (longer than default, never shorter): only the
    health sweep's declaration can start the repair within this test."""
    c = make_cluster(4, **DEAD_SOON, SMOLTORRENT_REPAIR_INTERVAL_S="3600")
    src = make_ckpt(tmp_path / "one.safetensors", size=2_000_000)
    digests = stored(c, src, "one.safetensors")
    beat(c)
    wait_until(lambda: c.md.sweeps.sweep_runs("health"), timeout=60, what="a health sweep")
    first = holder_of(c, digests[0])
    first.kill()
    survivors = [n for n in c.node_procs if n is not first]
    wait_until(lambda: at_r_on(c, digests, survivors), timeout=90, what="R copies on the survivors")


def test_replicas_raised_counts_no_copy_on_a_dead_node(make_cluster, tiny_tmp, tmp_path):
    """`store --replicas 3` on stored content while a holder is dead: the copies on the
    dead node must not count. Of the two live nodes without a copy, one fails every put,
    so one copy is made: two live copies and the dead one's in the placement. The command
    must not report the change done (it waits, then exits 3)."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    c = make_cluster(4, SMOLTORRENT_DEAD_AFTER_S="3", SMOLTORRENT_REPAIR_BACKOFF_S="3600")
    src = make_ckpt(tmp_path / "up.safetensors")
    c.cli("store", str(src), "--name", "up.safetensors")
    md = c.md
    vkey = md.versions.current("up.safetensors")
    (digest,) = {s.blob_sha256 for s in md.versions.manifest(vkey).entries}
    by_id = {n.client().ping(): n for n in c.node_procs}
    dead_id = sorted(md.blobs.placement(digest))[0]
    third, failing = sorted(set(by_id) - md.blobs.placement(digest))
    tiny_tmp(by_id[failing])
    by_id[dead_id].kill()
    forget_alive(md, dead_id)
    wait_until(lambda: node_health(md, 3)[dead_id].state == DEAD, 30, what="a dead node")
    store = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "store", str(src), "--name", "up.safetensors"]
        + ["--replicas", "3"],
        env=c.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: third in md.blobs.placement(digest) or store.poll() is not None,
            60,
            what="the copy made",
        )
        try:
            code = store.wait(timeout=5)  # ten of its looks at the copies
        except subprocess.TimeoutExpired:
            code = None  # still waiting for a third live copy, as it should
        assert code != 0, f"reported done with two live copies: {store.stdout.read()}"
        assert third in md.blobs.placement(digest)
    finally:
        store.kill()
        store.wait()


def test_a_failing_targets_backoff_doubles_from_a_minute_up_to_an_hour(
    make_cluster, tiny_tmp, tmp_path
):
    """self-healing.md: a copy that fails sends that target into a backoff for that blob,
    REPAIR_BACKOFF_S (60 s) after the first failure, doubling with each one after, up to
    1 h. Default backoff and repair interval; each wait is skipped by setting the record's
    `until` back in Redis, and the repair sweep run at once (run_sweep), not waited for."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    c = make_cluster(3, SMOLTORRENT_DEAD_AFTER_S="3")
    src = make_ckpt(tmp_path / "b.safetensors")
    c.cli("store", str(src), "--name", "b", "--shards", "1")
    md = c.md
    (digest,) = [s.blob_sha256 for s in md.versions.manifest(md.versions.current("b")).entries]
    by_id = {n.client().ping(): n for n in c.node_procs}
    dead_id = min(md.blobs.placement(digest))
    (failing_id,) = set(by_id) - md.blobs.placement(digest)
    tiny_tmp(by_id[failing_id])  # the only target left: every put it takes fails
    by_id[dead_id].kill()
    forget_alive(md, dead_id)
    wait_until(lambda: node_health(md, 3)[dead_id].state == DEAD, 30, what="a dead node")
    run_sweep(c, "health")
    field = f"{digest}:{failing_id}"

    def record() -> dict | None:
        raw = md.r.hget(K.REPAIR_BACKOFF, field)
        return json.loads(raw) if raw else None

    delays = []
    for failures in range(1, 8):
        run_sweep(c, "repair")
        got = wait_until(
            lambda n=failures: (r := record()) and r["failures"] == n and r,
            60,
            what=f"failure {failures} recorded",
        )
        delays.append(got["until"] - time.time())
        # Its wait over (the record's time set back, not waited): the next sweep sends it.
        md.r.hset(K.REPAIR_BACKOFF, field, json.dumps(got | {"until": time.time() - 1}))
    wanted = [
        min(defaults.REPAIR_BACKOFF_S * 2**n, defaults.REPAIR_BACKOFF_MAX_S) for n in range(7)
    ]
    assert wanted == [60, 120, 240, 480, 960, 1920, 3600]
    # Each recorded `until` is the failure's time plus the backoff; read a moment later.
    assert all(w - 30 < d <= w for d, w in zip(delays, wanted, strict=True)), delays
    assert failing_id not in md.blobs.placement(digest)  # no copy was ever counted there


def test_a_trim_that_finds_its_kept_copies_rotten_deletes_no_surplus(make_cluster, tmp_path):
    """self-healing.md: copies above R are trimmed keeping R copies that re-hash clean
    first. Three copies of a blob at R=2, two of them rotted in place (same size): a trim
    that kept two unchecked copies would delete the third, maybe the only clean one.
    It must find fewer than R clean copies and delete nothing."""
    from tests.beat.test_scrub import flip_byte, whole  # test_scrub imports this module

    c = make_cluster(3)
    src = make_ckpt(tmp_path / "old.safetensors")
    blob, ids = stored_with_a_surplus_copy(c, src)
    clean_id, *rotten_ids = sorted(c.md.blobs.placement(blob))
    assert len(rotten_ids) == 2
    for node_id in rotten_ids:
        flip_byte(ids[node_id], blob, 100)
    from celery import Celery

    app = Celery(broker=c.redis_url, backend=c.redis_url)
    try:
        result = app.send_task(
            "smoltorrent.trim", kwargs={"digest": blob, "replicas": 2}, queue="control"
        ).get(timeout=120)
    finally:
        app.close()
    assert result["deleted"] == [], result
    assert result["kept"] == [clean_id], result
    assert whole(ids[clean_id], blob)
    # The rotten copies leave the placement (their nodes quarantined them); the clean one
    # stays counted, and repair makes the second copy from it.
    assert c.md.blobs.placement(blob) == {clean_id}


def test_a_worker_killed_mid_repair_frees_its_sessions_when_it_starts_again(
    make_cluster, beat, tmp_path
):
    """Invariant 13: the repair sessions a SIGKILLed worker was running are free again at its
    next boot, which plans the repair on. They held the throttle until their records'
    deadlines (a session's time limit and the reconcile grace: minutes), and the blobs
    stayed below R that long (the 30-minute chaos run of 2026-12-06: 457 blobs for 108 s).
    The repair sweep is an hour apart (longer than default, never shorter): within this
    test only the boot can carry the repair on."""
    c = make_cluster(
        4, **DEAD_SOON, SMOLTORRENT_REPAIR_INTERVAL_S="3600", SMOLTORRENT_REPAIR_BPS="300000"
    )
    src = make_blobs_ckpt(tmp_path / "many.safetensors", 8)
    digests = stored(c, src, "many.safetensors")
    beat(c)
    wait_until(lambda: c.md.sweeps.sweep_runs("health"), timeout=60, what="a health sweep")
    by_id = {n.client().ping(): n for n in c.node_procs}
    lost = max(by_id, key=lambda i: sum(i in c.md.blobs.placement(d) for d in digests))
    by_id[lost].kill()
    survivors = [n for n in c.node_procs if n is not by_id[lost]]
    # Each session carries ~1 MiB or more at 300 KB/s: seconds, so it is killed mid-copy.
    wait_until(
        lambda: c.md.r.hlen(K.REPAIRS) and "smoltorrent.repair[" in c.worker_log(),
        timeout=90,
        what="a repair session under way",
    )
    time.sleep(1.0)  # the session's task started (received, then run at once: a free slot)
    dead = [json.loads(r) for r in c.md.r.hgetall(K.REPAIRS).values()]
    c.kill_worker()
    c.start_worker()
    wait_until(lambda: at_r_on(c, digests, survivors), timeout=120, what="R on the survivors")
    assert c.md.sweeps.redis_time() < min(r["deadline"] for r in dead)
