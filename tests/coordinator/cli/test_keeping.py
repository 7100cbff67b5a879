"""Issue 24's papercuts about what is kept and what goes: `rm` of every version asks first,
`pin`/`unpin` and `tag` (issue 24), retention per prefix (issue 22). Each runs through the
real CLI as a subprocess against one real cluster for the module (Redis, two shard
servers, a Celery worker); every test uses names of its own."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.synthetic import write_checkpoint
from tests.beat.test_retention import sweep
from tests.coordinator.cli.test_papercuts import TIMEOUT_S, run
from tests.tasks.conftest import Cluster, wait_until

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(
        tmp_path_factory.mktemp("keeping"),
        nodes=2,
        host_id="keeping",
        extra_env={"SMOLTORRENT_KEEP_LAST": "2"},
    )
    try:
        cluster.start()
        cluster.register_nodes()
        yield cluster
    finally:
        cluster.kill_worker()
        cluster.stop()


def store(c: Cluster, tmp_path: Path, name: str) -> str:
    """Store new content under `name` (one shard, one copy); its version id."""
    src = tmp_path / f"src-{time.monotonic_ns()}.safetensors"
    write_checkpoint(src, 60_000, hidden=16)
    past = time.time() - 60  # settled: the store does not wait for the file to settle
    os.utime(src, (past, past))
    stored = run("store", str(src), "--name", name, "--replicas", "1", "--json", env=c.env())
    assert stored.returncode == 0, stored.stderr
    return json.loads(stored.stdout)["version_id"]


def version_ids(c: Cluster, name: str) -> list[str]:
    return [c.md.versions.version(v)["version_id"] for v in c.md.versions.versions(name)]


def on_a_terminal(c: Cluster, argv: list[str], answer: str) -> tuple[int, str]:
    """Run the CLI with a terminal for stdin, stdout and stderr; once it asks (a line
    ending in "[y/N] "), type `answer`. Its exit status and everything it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=c.env(),
    )
    os.close(slave)
    seen, answered = b"", False
    try:
        while True:
            ready, _, _ = select.select([master], [], [], TIMEOUT_S)
            assert ready, f"no output for {TIMEOUT_S} s: {seen!r}"
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the command exited and closed the terminal
                break
            if not chunk:
                break
            seen += chunk
            if not answered and b"[y/N] " in seen:
                os.write(master, answer.encode() + b"\n")
                answered = True
        # Without the colours rich puts on a terminal.
        return proc.wait(timeout=TIMEOUT_S), ANSI.sub("", seen.decode(errors="replace"))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_rm_of_every_version_asks_on_a_terminal_and_refuses_in_a_script(c: Cluster, tmp_path: Path):
    """`rm NAME` removed every version at once, with no question and no dry run."""
    name = "rm/asked.safetensors"
    ids = [store(c, tmp_path, name) for _ in range(2)]
    refused = run("rm", name, env=c.env())  # stdin is not a terminal: a script
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--yes" in refused.stderr and "--dry-run" in refused.stderr
    assert version_ids(c, name) == ids
    dry = run("rm", name, "--dry-run", env=c.env())
    assert dry.returncode == 0, dry.stderr
    assert all(i[:12] in dry.stdout for i in ids) and "nothing removed" in dry.stdout
    assert version_ids(c, name) == ids
    answer = json.loads(run("rm", name, "--dry-run", "--json", env=c.env()).stdout)
    assert sorted(v["version_id"] for v in answer["would_remove"]) == sorted(ids)
    code, said = on_a_terminal(c, ["rm", name], "n")
    assert code == 1 and "remove 2 versions of rm/asked.safetensors" in said, said
    assert "nothing removed" in said
    assert version_ids(c, name) == ids
    code, said = on_a_terminal(c, ["rm", name], "y")
    assert code == 0 and "removed 2 version(s)" in said, said
    assert version_ids(c, name) == []
    # --yes needs no question; one version (--version) is asked about by none.
    other = "rm/yes.safetensors"
    first, second = store(c, tmp_path, other), store(c, tmp_path, other)
    one = run("rm", other, "--version", first[:12], env=c.env())
    assert one.returncode == 0 and version_ids(c, other) == [second], one.stderr
    whole = run("rm", other, "--yes", env=c.env())
    assert whole.returncode == 0 and version_ids(c, other) == [], whole.stderr


def sweep_and_settle(c: Cluster) -> dict:
    """One retention pass, then wait for the removes it sent to finish."""
    outcomes = sweep(c)
    wait_until(
        lambda: not any(s == "removing" for s in c.md.listing.version_states().values()),
        TIMEOUT_S,
        what="the removes",
    )
    return outcomes


def test_pin_keeps_a_version_from_retention_and_a_tag_names_one(c: Cluster, tmp_path: Path):
    """There was no way to keep one good version past the last K, nor to name one."""
    name = "pin/latest.safetensors"
    ids = [store(c, tmp_path, name) for _ in range(4)]  # the cluster keeps the last 2
    pinned = run("pin", name, ids[0][:12], env=c.env())
    assert pinned.returncode == 0 and "pinned" in pinned.stdout, pinned.stderr
    tagged = run("tag", name, ids[2][:12], "best", env=c.env())
    assert tagged.returncode == 0, tagged.stderr
    listing = run("ls", name, env=c.env())
    header, *rows = [line.split("\t") for line in listing.stdout.splitlines()]
    kept = {row[0]: row[header.index("kept")] for row in rows}
    assert kept == {ids[0][:12]: "pinned", ids[1][:12]: "", ids[2][:12]: "@best", ids[3][:12]: ""}
    answer = {r["version_id"]: r for r in json.loads(run("ls", name, "--json", env=c.env()).stdout)}
    assert answer[ids[0]]["pinned"] and answer[ids[2]]["tags"] == ["best"]
    assert sweep_and_settle(c).get("retired") == 1
    assert version_ids(c, name) == [ids[0], ids[2], ids[3]]  # the pinned one stayed
    shown = json.loads(run("show", f"{name}@best", "--json", env=c.env()).stdout)
    assert shown["version_id"] == ids[2]
    out = tmp_path / "best.safetensors"
    gathered = run("gather", f"{name}@best", "-o", str(out), "--json", env=c.env())
    assert gathered.returncode == 0, gathered.stderr
    assert json.loads(gathered.stdout)["version_id"] == ids[2]
    missing = run("gather", f"{name}@worst", "-o", str(tmp_path / "x"), env=c.env())
    assert missing.returncode == 1 and "tagged 'worst'" in missing.stderr
    # A label moves: one version of a name has it at a time.
    assert run("tag", name, ids[3][:12], "best", env=c.env()).returncode == 0
    assert (
        json.loads(run("show", f"{name}@best", "--json", env=c.env()).stdout)["version_id"]
        == ids[3]
    )
    # rm refuses a pinned version; unpinned, retention takes it.
    refused = run("rm", name, "--yes", env=c.env())
    assert refused.returncode == 1 and "pinned" in refused.stderr, refused.stderr
    # Its hint is the command itself, not one with NAME VERSION to fill in.
    assert f"`smoltorrent unpin {name} {ids[0][:12]}`" in refused.stderr, refused.stderr
    # A dry run lists what would go (it failed with exit 1 before), and what stops it.
    dry = run("rm", name, "--dry-run", env=c.env())
    assert dry.returncode == 0, dry.stderr
    assert all(i[:12] in dry.stdout for i in (ids[0], ids[2], ids[3])), dry.stdout
    assert f"smoltorrent unpin {name} {ids[0][:12]}" in dry.stderr, dry.stderr
    assert version_ids(c, name) == [ids[0], ids[2], ids[3]]
    assert run("unpin", name, ids[0][:12], env=c.env()).returncode == 0
    assert sweep_and_settle(c).get("retired") == 1
    assert version_ids(c, name) == [ids[2], ids[3]]


def test_retention_per_prefix_keeps_the_newest_k_steps_of_a_run(c: Cluster, tmp_path: Path):
    """Retention kept the last K per name, so a run saving run/step_N.safetensors (one name
    a step) was never pruned (issue 22)."""
    steps = [f"run9/step_{n}.safetensors" for n in range(1, 6)]
    ids = {step: store(c, tmp_path, step) for step in steps}
    assert run("pin", steps[0], env=c.env()).returncode == 0
    refused = run("retain", "run9", "--keep", "2", env=c.env())
    assert refused.returncode == 2 and "ending in /" in refused.stderr
    dry = run("retain", "run9/", "--keep", "2", "--dry-run", "--json", env=c.env())
    assert json.loads(dry.stdout)["would_remove"] == steps[:3], dry.stdout
    assert "no retention rules" in run("retain", env=c.env()).stdout
    set_rule = run("retain", "run9/", "--keep", "2", env=c.env())
    assert set_rule.returncode == 0, set_rule.stderr
    assert json.loads(run("retain", "--json", env=c.env()).stdout) == {"run9/": 2}
    outcomes = sweep_and_settle(c)
    assert outcomes.get("retired") == 2 and outcomes.get("pinned") == 1, outcomes
    listed = json.loads(run("ls", "run9/", "--json", env=c.env()).stdout)
    assert sorted(r["name"] for r in listed) == [steps[0], *steps[3:]]
    assert all(r["current"] for r in listed)
    out = tmp_path / "newest.safetensors"
    newest = run("gather", steps[-1], "-o", str(out), "--json", env=c.env())
    assert newest.returncode == 0 and json.loads(newest.stdout)["version_id"] == ids[steps[-1]]
    # A new step: the oldest unpinned one goes at the next pass.
    store(c, tmp_path, "run9/step_6.safetensors")
    assert sweep_and_settle(c).get("retired") == 1
    names = sorted(r["name"] for r in json.loads(run("ls", "run9/", "--json", env=c.env()).stdout))
    assert names == [steps[0], steps[4], "run9/step_6.safetensors"]
    assert run("retain", "run9/", "--off", env=c.env()).returncode == 0
    assert json.loads(run("retain", "--json", env=c.env()).stdout) == {}
