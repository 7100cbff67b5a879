"""An FSDP2 job of 2 ranks (torchrun, gloo on CPU) saving through smoltorrent.dcp, killed
with SIGKILL partway through a save and restarted by torchrun: it resumes from the newest
complete step, bit-identical with a run never interrupted, and that state reshards to
1 and 4 ranks as DCP's own files do. The ranks: tests/smoltorrent/dcp_resume_run.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.smoltorrent.conftest import ROOT
from tests.smoltorrent.dcp_resume_run import SAVE_EVERY, STEPS

KILL_STEP = 4  # the second save: one complete step (2) is behind it, steps 5-6 after it
HOLD_TIMEOUT_S = 90  # attempt 0 reaches KILL_STEP's save in ~10 s alone on 2 cores
JOB_TIMEOUT_S = 240  # a job takes ~15 s alone on 2 cores, ~30 s beside a loaded CI run
STOP_GRACE_S = 40  # torchrun's own grace for its ranks on SIGTERM is 30 s


def torchrun(cluster, ranks: int, *args: str, restarts: int = 0) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={ranks}",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",  # a dead rank is seen at once, not after 5 s
            "-m",
            "tests.smoltorrent.dcp_resume_run",
            *args,
        ],
        # The restarted ranks get a TCPStore of their own: sharing the agent's across
        # restarts (torch's default) hands them the dead attempt's gloo addresses
        # (pytorch/pytorch#135712; "Gloo connectFullMesh failed ... Connection refused"
        # here in 2 of 4 runs).
        env={**cluster.env(), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> None:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}"


def stop(proc: subprocess.Popen, held_pid: int | None = None) -> None:
    """A job the test gave up on ends with it: the held rank (stopped, it would never
    act on SIGTERM) killed, then torchrun asked to stop, as it then stops its ranks."""
    if held_pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(held_pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def held(out: Path, proc: subprocess.Popen) -> dict:
    """What rank 0 wrote when it stopped itself mid-save (the job stopped if it never does)."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    try:
        while not (out / "held").exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"the job ended (exit {proc.returncode}) before the hold\n"
                    f"{proc.communicate()[0]}"
                )
            assert time.monotonic() < deadline, "rank 0 never reached the held save"
            time.sleep(0.05)
    except BaseException:
        late = out / "held"  # written just as the wait ended: that rank is stopped too
        stop(proc, json.loads(late.read_text())["pid"] if late.exists() else None)
        raise
    return json.loads((out / "held").read_text())


def losses(out: Path, run: str, rank: int) -> dict[int, str]:
    lines = (out / f"losses-{run}-{rank}").read_text().splitlines()
    return dict(json.loads(line) for line in lines)


def test_an_fsdp2_job_killed_mid_save_resumes_bit_identical_and_reshards(make_cluster, tmp_path):
    c = make_cluster(2)
    out = tmp_path / "out"
    out.mkdir()
    job = torchrun(c, 2, "train", str(out), "run", str(KILL_STEP), restarts=1)
    hold = held(out, job)
    os.kill(hold["pid"], signal.SIGKILL)  # rank 0, its part in flight
    finished(job)  # torchrun restarted both ranks, which resumed and trained to the end
    # The killed rank's part was a file in memory (/dev/shm) it never got to delete: the
    # next save on this host deleted it (no process held it), or it would hold that
    # memory until the machine reboots.
    assert not Path(hold["path"]).exists(), hold

    # The crash left step 4 pending, rank 1's part recorded and rank 0's not: the resumed
    # job found step 2 the newest complete step, and resumed from it.
    found = json.loads((out / "found").read_text())
    assert found == {
        "latest": f"run/step_{KILL_STEP - SAVE_EVERY}",
        "killed_step": {"state": "pending", "parts": [1]},
    }, found
    for rank in (0, 1):
        reference = losses(out, "reference", rank)
        killed, resumed = losses(out, "killed", rank), losses(out, "resumed", rank)
        assert sorted(reference) == list(range(1, STEPS + 1))
        assert sorted(killed) == list(range(1, KILL_STEP + 1))
        assert sorted(resumed) == list(range(KILL_STEP - SAVE_EVERY + 1, STEPS + 1))
        # The loss curve, exactly: what the killed run saw up to its last complete step,
        # then what the resumed run saw, is the uninterrupted run's (and the steps both
        # ran agree too).
        assert {**killed, **resumed} == reference, rank
        assert {s: killed[s] for s in resumed if s in killed} == {
            s: resumed[s] for s in resumed if s in killed
        }
        # Parameters and AdamW's state (exp_avg, exp_avg_sq, step), this rank's shards,
        # bit for bit.
        ref = json.loads((out / f"reference-{rank}.json").read_text())
        res = json.loads((out / f"resumed-{rank}.json").read_text())
        assert sorted(k for k in ref.keys() | res.keys() if ref.get(k) != res.get(k)) == []
        assert sum(1 for v in ref.values() if isinstance(v, list)) == 16

    # The final step (saved by 2 ranks) loaded by 4 ranks and by one process with no
    # process group, through Reader and through FileSystemReader: the same tensors.
    finished(torchrun(c, 4, "reshard", str(out), f"run/step_{STEPS}"))
    for rank in range(4):
        found = json.loads((out / f"reshard-4-{rank}.json").read_text())
        assert found["step"] == STEPS
        assert (found["differ"], found["tensors"]) == ([], 16), (rank, found)
        if rank == 0:
            assert (found["plain_differ"], found["plain_tensors"]) == ([], 16), found
            assert found["whole_differ"] == [], found


def test_a_part_file_is_swept_once_no_process_holds_it(tmp_path, monkeypatch):
    """The sweep the kill-and-resume test relies on, alone: a part file whose writer died
    (nothing holds it) goes, a live one (held, as each writer holds its own) stays, and
    so does a file of the older, unlocked naming (maybe an older smoltorrent's save in
    flight)."""
    from smoltorrent.dcp import scratch

    monkeypatch.setattr(scratch, "directory", lambda: tmp_path)
    orphan = tmp_path / ".dcp-part.0123.safetensors"  # no process holds it
    orphan.write_bytes(b"x")
    older = tmp_path / ".dcp.4567.safetensors"
    older.write_bytes(b"x")
    with scratch.part_file() as live:  # sweeps first
        assert not orphan.exists()
        assert scratch.sweep(tmp_path) == []  # held by this block
        assert live.exists() and older.exists()
    assert not live.exists()  # its writer deletes it
    assert sorted(p.name for p in tmp_path.iterdir()) == [older.name]
