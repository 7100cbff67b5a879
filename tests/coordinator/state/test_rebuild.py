"""coordinator/state/rebuild.py: the metadata rebuilt from the nodes, against a real
cluster whose Redis is killed and started again with its data gone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from coordinator.local.synthetic import write_checkpoint
from coordinator.plan.manifest import Manifest
from tests.tasks.conftest import make_cluster, wait_until  # noqa: F401  (the fixture, shared)

NAME = "run/latest.safetensors"


def test_pins_and_labels_come_back_after_losing_redis_and_a_rebuild(make_cluster, tmp_path):  # noqa: F811
    """Pins and labels lived in Redis alone, so a rebuild from the nodes brought every
    version back unpinned and untagged: retention could then remove what was pinned, and
    `gather NAME@best` named nothing. A label moved to another version and a pin taken off
    come back as they were last set, not as first set."""
    c = make_cluster(2)
    sources, ids = [], []
    for i in range(3):
        src = tmp_path / f"v{i}.safetensors"
        write_checkpoint(src, 200_000 + 10_000 * i, hidden=32)
        os.utime(src, (time.time() - 60, time.time() - 60))
        sources.append(src)
        ids.append(c.cli_json("store", str(src), "--name", NAME)["version_id"])
    c.cli("pin", NAME, ids[0][:12])
    c.cli("tag", NAME, ids[0][:12], "first")
    c.cli("tag", NAME, ids[1][:12], "best")
    c.cli("pin", NAME, ids[1][:12])
    c.cli("tag", NAME, ids[2][:12], "best")  # taken from ids[1]
    c.cli("unpin", NAME, ids[1][:12])

    c.kill_redis()
    shutil.rmtree(c.root / "redis")  # its AOF too: every key is lost
    c.start_redis()
    assert c.cli_json("ls") == []
    summary = c.cli_json("rebuild", *(str(n.address) for n in c.node_procs))
    assert summary["restored"] == 3, summary

    marks = {r["version_id"]: (r["pinned"], r["tags"]) for r in c.cli_json("ls", NAME)}
    assert marks == {ids[0]: (True, ["first"]), ids[1]: (False, []), ids[2]: (False, ["best"])}
    out = tmp_path / "out.safetensors"
    c.cli("gather", f"{NAME}@best", "-o", str(out))
    assert out.read_bytes() == sources[2].read_bytes()


def test_replicas_asked_for_while_a_node_was_down_come_back_after_losing_redis(
    make_cluster,  # noqa: F811
    tmp_path,
):
    """`store --replicas 3` on stored content: its store task puts the version's manifest
    again on the live holders with that request's number, then set_replicas records R=3
    and the replicas task puts it once more, at the same number. A holder that died
    between the two kept R=2 at that number, and a rebuild took the first copy it read at
    an equal number: with that node read first, R=2 came back (and repair would trim the
    third copy the user asked for). The R change now takes a number of its own
    (marks_seq), and a rebuild takes R from the copy that carries the highest."""
    c = make_cluster(4)
    src = tmp_path / "a.safetensors"
    write_checkpoint(src, 300_000, hidden=32)
    os.utime(src, (time.time() - 60, time.time() - 60))
    c.cli("store", str(src), "--name", NAME, "--replicas", "2")
    # The store task of `store --replicas 3`: every holder takes this request's number.
    c.cli("store", str(src), "--name", NAME)
    vkey = c.md.versions.current(NAME)
    holding = [n for n in c.node_procs if vkey in n.client().list_manifests()]
    down = holding[0]
    down.kill()
    # The rest of `store --replicas 3` (coordinator/cli/transfer_commands._change_replicas).
    assert c.md.versions.set_replicas(vkey, 3) == 2
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tasks.enqueue import send_replicas; send_replicas(*sys.argv[1:])",
            vkey,
            NAME,
        ],
        env=c.env(),
        check=True,
        timeout=60,
    )
    live = [n for n in holding if n is not down]

    def told() -> bool:
        return all(Manifest.from_json(n.client().get_manifest(vkey)).replicas == 3 for n in live)

    wait_until(told, what="the live holders' manifests to say R=3")
    down.start()

    c.kill_redis()
    shutil.rmtree(c.root / "redis")
    c.start_redis()
    # The node that was down is read first.
    order = [down, *(n for n in c.node_procs if n is not down)]
    summary = c.cli_json("rebuild", *(str(n.address) for n in order))
    assert summary["restored"] == 1, summary
    [row] = c.cli_json("ls", NAME)
    assert row["replicas"] == 3
