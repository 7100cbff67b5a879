"""The repair sweep on a real cluster: `smoltorrent beat` with second-long intervals,
a real worker, real node processes killed with SIGKILL and started again."""

from __future__ import annotations

from collections import Counter

from coordinator.state.metadata import COMMITTED
from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt, sha

FAST = {
    "SMOLTORRENT_HEALTH_INTERVAL_S": "1",
    "SMOLTORRENT_DEAD_AFTER_S": "3",
    "SMOLTORRENT_REPAIR_INTERVAL_S": "1",
}


def stored(c, src, name: str) -> list[str]:
    """Store src at R=2 through the CLI; the blob digests of the committed version."""
    c.cli("store", str(src), "--name", name)
    md = c.md
    vkey = md.current(name)
    assert md.version(vkey)["state"] == COMMITTED
    return [s.blob_sha256 for s in md.manifest(vkey).shards]


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
    return all(len(md.placement(d) & ids) >= r and on_disk[d] >= r for d in digests)


def test_a_dead_node_is_re_replicated_and_a_second_death_loses_nothing(
    make_cluster, beat, tmp_path
):
    c = make_cluster(4, **FAST)
    src = make_ckpt(tmp_path / "big.safetensors", size=8_000_000)
    digests = stored(c, src, "big.safetensors")
    first = c.node_procs[0]
    first_id = first.client().ping()
    holders_before = {d: c.md.placement(d) for d in digests}
    assert any(first_id in h for h in holders_before.values())
    beat(c)
    first.kill()
    survivors = c.node_procs[1:]
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
    returning = c.node_procs[0]
    returning_id = returning.client().ping()
    held_before = set(returning.client().list_blobs())
    assert held_before
    beat(c)
    returning.kill()
    others = c.node_procs[1:]
    wait_until(lambda: at_r_on(c, digests, others), timeout=120, what="R copies on the others")

    returning.start()
    wait_until(lambda: returning_id not in c.md.declared_dead(), timeout=60, what="re-admission")

    def exactly_r() -> bool:
        on_disk = copies_on_disk(c.node_procs)
        return all(on_disk[d] == 2 and len(c.md.placement(d)) == 2 for d in digests)

    wait_until(exactly_r, timeout=120, what="the surplus copies trimmed")
    assert c.md.r.hget("smoltorrent:repairs:counts", "trimmed")
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
    wait_until(lambda: gone_id in c.md.declared_dead(), timeout=60, what="the node declared dead")

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
