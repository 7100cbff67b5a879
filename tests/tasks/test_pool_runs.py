"""Every pool process says what it runs (tasks/pool_runs.py), and the reconnection's
re-drive believes it over a result that never reached the main process."""

from __future__ import annotations

import os
import subprocess

from celery import signals
from celery.worker import state

from tests.tasks.conftest import wait_until
from tests.tasks.test_control_plane import make_ckpt


class _Task:
    """What a pool process's signal gives: the task, with its request's id and retries."""

    def __init__(self, task_id: str, retries: int):
        self.request = type("Context", (), {"id": task_id, "retries": retries})()


class _Request:
    """What the main process holds for a task: its id, headers and pool process."""

    def __init__(self, task_id: str, retries: int, worker_pid: int | None):
        self.id, self.name, self.args, self.kwargs = task_id, "smoltorrent.chain", [], {}
        self.request_dict = {"retries": retries}
        self.worker_pid = worker_pid


def test_a_run_is_ended_only_once_its_own_process_says_so():
    from tasks import pool_runs

    me = os.getpid()
    first, retry = _Request("chain-x", 2, me), _Request("chain-x", 3, me)
    try:
        assert not pool_runs.ended(first)  # said nothing yet
        pool_runs._on_start(task=_Task("chain-x", 2))
        assert not pool_runs.ended(first)
        pool_runs._on_end(task=_Task("chain-x", 2))
        assert pool_runs.ended(first)
        # Its retry keeps the id: handed to the same process, not ended by the first's word.
        assert not pool_runs.ended(retry)
        pool_runs._on_start(task=_Task("chain-x", 3))
        assert not pool_runs.ended(first) and not pool_runs.ended(retry)
        assert not pool_runs.ended(_Request("chain-x", 3, None))  # no process yet
        assert not pool_runs.ended(_Request("chain-x", 3, me + 1_000_000))  # another's
    finally:
        pool_runs._clear()


def test_a_process_that_cannot_say_its_run_started_leaves_no_word_of_its_last():
    """Its last run's "ended" must not stand for the run it could not announce: a hard
    time limit on that one would be taken for a lost result (tasks/dead_letters.py)."""
    from tasks import pool_runs

    try:
        pool_runs._on_end(task=_Task("chain-y", 0))
        assert pool_runs.result_lost("chain-y")
        (pool_runs.DIRECTORY / f"{os.getpid()}.tmp").mkdir()  # its next word cannot be written
        pool_runs._on_start(task=_Task("chain-y", 1))
        assert not pool_runs.result_lost("chain-y")
    finally:
        pool_runs._clear()


def test_the_reconnection_does_not_count_a_run_its_process_said_ended():
    """A chain shown running whose result was lost with the connection (its process said
    it ended) holds nothing: its shard is sent again, and the re-check does not wait for it
    to end. One still running holds its shard."""
    from beat import reconnect
    from tasks import pool_runs

    me = os.getpid()
    lost = _Request("chain-lost", 2, me)
    lost.kwargs = {"vkey": "v", "shard": 0}
    state.active_requests.add(lost)
    try:
        pool_runs._on_start(task=_Task("chain-lost", 2))
        assert [call[1] for call in reconnect.in_worker()] == ["chain-lost"]
        assert reconnect.running_ids() == {"chain-lost"}
        pool_runs._on_end(task=_Task("chain-lost", 2))
        assert reconnect.in_worker() == [] and reconnect.running_ids() == set()
    finally:
        state.active_requests.discard(lost)
        pool_runs._clear()


def test_the_worker_app_has_every_pool_process_say_what_it_runs():
    import tasks.app  # noqa: F401
    from tasks import pool_runs

    assert pool_runs._on_start in [r for _, r in signals.task_prerun.receivers]
    assert pool_runs._on_end in [r for _, r in signals.task_postrun.receivers]


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_real_worker_s_pool_processes_say_their_runs_ended(make_cluster, tmp_path):
    """Said by the pool processes of a real worker: each that ran a task names its last
    run, ended, in a directory of the worker's own; gone when the worker stops. A worker
    that was SIGKILLed left its directory behind: the next worker's start removes it."""
    from tasks.pool_runs import DIRECTORY

    ram = DIRECTORY.parent  # the worker's is beside this process's
    gone = ram / f"smoltorrent-runs-{_dead_pid()}-{'0' * 32}"
    gone.mkdir()
    (gone / "12345").write_text("chain-old#0 ended")
    c = make_cluster(2)
    c.cli_json("store", str(make_ckpt(tmp_path / "p.safetensors")))
    children = subprocess.run(
        ["pgrep", "-P", str(c.worker.pid)], capture_output=True, text=True
    ).stdout.split()
    [directory] = ram.glob(f"smoltorrent-runs-{c.worker.pid}-*")

    def said() -> dict[str, str]:
        return {
            p.name: p.read_text()
            for p in directory.iterdir()
            if p.name in children and p.read_text().endswith(" ended")
        }

    words = wait_until(said, timeout=30, what="a pool process to say its run ended")
    assert all("#" in w for w in words.values())
    assert not gone.exists()
    c.stop_worker()
    assert not directory.exists()


def test_a_starting_worker_removes_only_the_directories_of_workers_gone(tmp_path):
    from tasks import pool_runs

    ram = pool_runs.DIRECTORY.parent
    kept = [
        ram / f"smoltorrent-runs-{os.getpid()}-{'1' * 32}",  # its worker alive
        ram / f"smoltorrent-runs-{_dead_pid()}-not-a-boot-id",  # not ours to judge
    ]
    gone = ram / f"smoltorrent-runs-{_dead_pid()}-{'2' * 32}"
    try:
        for path in [*kept, gone]:
            path.mkdir()
        pool_runs._remove_the_gone()
        assert all(p.is_dir() for p in kept) and not gone.exists()
    finally:
        for path in [*kept, gone]:
            if path.exists():
                path.rmdir()
