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
from tests.coordinator.cli.test_papercuts import TIMEOUT_S, run
from tests.tasks.conftest import Cluster

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
