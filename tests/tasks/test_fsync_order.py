"""Where a gather's and a save's fsyncs are, read from their system calls
(tests/syscall_order.py), as the nodes' are (tests/worker_server/test_fsync_order.py).

A gathered file is fsynced before it is renamed onto the destination, and the directory
after, before the command prints that it is there (invariant 2's file, durable when the
user is told). A save's journal record is fsynced before its rename, and the journal
directory after, before save() returns (invariant 12: durable from then on; the trainer
prints once it has returned).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from coordinator.config import GATHER_DIRS_ENV
from tests.smoltorrent.conftest import ROOT
from tests.syscall_order import STRACE, DurableOrder, prints, require_strace, under
from tests.tasks.test_control_plane import make_ckpt


def strace_run(c, trace, argv: list[str]) -> subprocess.CompletedProcess:
    # Only the cluster's own root is where its worker gathers: a gather elsewhere runs in
    # the traced process itself.
    env = c.env() | {GATHER_DIRS_ENV: str(c.root)}
    done = subprocess.run(
        [*STRACE, "-o", str(trace), "--", sys.executable, *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_a_gathered_file_and_a_saves_journal_are_durable_before_they_are_said(
    make_cluster, tmp_path
):
    require_strace()
    c = make_cluster(2)
    source = make_ckpt(tmp_path / "m.safetensors")
    c.cli("store", str(source), "--name", "run/m.safetensors")
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    strace_run(
        c,
        tmp_path / "gather.trace",
        ["-m", "coordinator.cli", "gather", "run/m.safetensors", "-o", str(out), "--json"],
    )
    assert out.read_bytes() == source.read_bytes()
    trace = (tmp_path / "gather.trace").read_text()
    gather = DurableOrder(under(out.parent), prints(trace)).read(trace)
    assert gather.faults == []
    assert (gather.made, gather.acknowledged) == (1, 1)

    staging = tmp_path / "staging"
    save = f"""
        import numpy as np, smoltorrent
        smoltorrent.save({{"w": np.ones((64, 64), np.float32)}}, "run/s.safetensors",
                         wait=False, staging_dir={str(staging)!r})
        print("saved", flush=True)
    """
    strace_run(c, tmp_path / "save.trace", ["-c", textwrap.dedent(save)])
    trace = (tmp_path / "save.trace").read_text()
    journal = DurableOrder(under(staging / "journal"), prints(trace)).read(trace)
    assert journal.faults == []
    # Its record made, and said; the writer process may have removed it since (the
    # version committed), which is no promise to the trainer (a record that outlived a
    # power cut is adopted again by the next writer).
    assert journal.acknowledged == 1 and journal.made >= 1
