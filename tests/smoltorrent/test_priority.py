"""smoltorrent/priority.py: a trainer's writer process runs below the trainer, its nice
value and its session's autogroup (Linux) both lowered, every one of its threads too,
and its saves are stored as before. Real processes: a child per case, and a real save
through a local cluster whose writer is read from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from smoltorrent import defaults, priority
from tests.smoltorrent.conftest import ROOT

HAS_AUTOGROUP = os.path.exists(priority.AUTOGROUP)
OWN_NICE = os.getpriority(os.PRIO_PROCESS, 0)  # children start at it (0 unless run niced)

# A child that lowers itself, then reports its nice value, its autogroup's, and that of a
# thread started after, each read back from the kernel.
LOWERED = """
import json, os, sys, threading
from smoltorrent import priority
priority.lower(int(sys.argv[1]))
for t in threading.enumerate():
    if t.name == "autogroup-nice":
        t.join()
seen = {}
def later():
    seen["thread"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
t = threading.Thread(target=later)
t.start()
t.join()
print(json.dumps({"nice": os.getpriority(os.PRIO_PROCESS, 0), **seen,
                  "autogroup": priority.autogroup_nice()}))
"""


def lowered(nice: int, *, own_session: bool, launcher: tuple[str, ...] = ()) -> dict:
    proc = subprocess.run(
        [*launcher, sys.executable, "-c", LOWERED, str(nice)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=own_session,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cannot" not in proc.stderr, proc.stderr  # no warning: every change was made
    return json.loads(proc.stdout)


def thread_nices(pid: int) -> dict[int, int]:
    """Every thread of `pid` and its nice value, from /proc/PID/task/TID/stat (field 19)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def test_a_process_leading_its_session_lowers_its_nice_its_threads_and_its_autogroup():
    mine = priority.autogroup_nice()
    out = lowered(10, own_session=True)
    assert out["nice"] == max(OWN_NICE, 10)
    assert out["thread"] == out["nice"]  # a thread started after inherits it
    if HAS_AUTOGROUP:
        assert out["autogroup"] == 10
    assert priority.autogroup_nice() == mine  # the parent's group is another


def test_a_process_in_another_process_s_session_leaves_that_session_s_autogroup():
    """A writer started by hand in a shell shares that session's group with the trainer:
    lowering the group would lower the trainer too."""
    mine = priority.autogroup_nice()
    out = lowered(10, own_session=False)
    assert out["nice"] == max(OWN_NICE, 10)
    assert out["autogroup"] == mine
    assert priority.autogroup_nice() == mine


def test_a_process_already_nicer_stays_as_nice_and_zero_changes_nothing():
    nicer = min(19, OWN_NICE + 15)
    assert lowered(10, own_session=True, launcher=("nice", "-n", "15"))["nice"] == nicer
    out = lowered(0, own_session=True)
    assert out["nice"] == OWN_NICE
    if HAS_AUTOGROUP:
        assert out["autogroup"] == 0


def test_autogroup_nice_reads_the_kernel_s_line_and_none_without_one(tmp_path):
    line = tmp_path / "autogroup"
    line.write_text("/autogroup-413 nice 7\n")
    assert priority.autogroup_nice(str(line)) == 7
    assert priority.autogroup_nice(str(tmp_path / "absent")) is None


# The trainer's script: one save, stored (wait=True) and loaded back, then its writer's
# pid, which the test reads from /proc while the trainer (and so the writer) still lives.
SAVE = """
import json, os, numpy as np, smoltorrent
from smoltorrent import api, priority
state = {"w": np.arange(4096, dtype=np.float32)}
saved = smoltorrent.save(state, "priority/" + NAME)
back = smoltorrent.load("priority/" + NAME, framework="numpy")
(writer,) = api._writers.values()
print(json.dumps({"pid": writer.proc.pid, "equal": bool((back["w"] == state["w"]).all()),
                  "trainer": os.getpriority(os.PRIO_PROCESS, 0),
                  "trainer_autogroup": priority.autogroup_nice()}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the writer from /proc")
def test_a_saves_writer_runs_niced_with_its_autogroup_and_stores_as_before(
    make_cluster, api_session
):
    mine = OWN_NICE  # the trainer's, as it inherits it
    c = make_cluster(2)
    trainer = api_session(c)
    out = trainer.run(f"NAME = 'default'\n{textwrap.dedent(SAVE)}")
    assert out["equal"] is True
    assert set(thread_nices(out["pid"]).values()) == {max(mine, defaults.WRITER_NICE)}
    if HAS_AUTOGROUP:
        assert priority.autogroup_nice(f"/proc/{out['pid']}/autogroup") == defaults.WRITER_NICE
    assert out["trainer"] == mine  # the trainer itself is left as it was
    assert out["trainer_autogroup"] == priority.autogroup_nice()

    # SMOLTORRENT_WRITER_NICE=0: the writer as its trainer (the bench's A side).
    off = api_session(c)
    out = off.run(
        "import os\nos.environ['SMOLTORRENT_WRITER_NICE'] = '0'\n"
        f"NAME = 'off'\n{textwrap.dedent(SAVE)}"
    )
    assert out["equal"] is True
    assert set(thread_nices(out["pid"]).values()) == {mine}
    if HAS_AUTOGROUP:
        assert priority.autogroup_nice(f"/proc/{out['pid']}/autogroup") == 0
