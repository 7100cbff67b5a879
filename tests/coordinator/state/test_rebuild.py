"""coordinator/state/rebuild.py: the metadata rebuilt from the nodes, against a real
cluster whose Redis is killed and started again with its data gone."""

from __future__ import annotations

import os
import shutil
import time

from coordinator.local.synthetic import write_checkpoint
from tests.tasks.conftest import make_cluster  # noqa: F401  (the fixture, shared)

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
