"""A save is durable before save() returns, and nothing outside the training process
makes it raise or lose a save: no worker, a trainer SIGKILLed right after its save, a
trainer and its writer process both SIGKILLed. Real Redis, nodes, worker and processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from coordinator.local.chaos import FAKETIME_LIB
from smoltorrent import defaults
from tests.smoltorrent.conftest import ROOT, run_api


def stored(c, name: str, count: int, timeout: float = 90) -> list[dict]:
    """The committed versions of `name` once there are `count` of them."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [v for v in c.cli_json("ls") if v["name"] == name and v["state"] == "committed"]
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def writer_pids(c) -> list[int]:
    """The writer processes the test's trainers left running (they exit once done)."""
    ps = subprocess.run(["ps", "-axo", "pid=,command="], capture_output=True, text=True)
    return [
        int(line.split(None, 1)[0])
        for line in ps.stdout.splitlines()
        if "smoltorrent.snapshot_writer" in line and str(c.root) in line
    ]


def kill_writers(c) -> None:
    for pid in writer_pids(c):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def current_value(c, name: str) -> float:
    """w[0, 0] of `name`'s current version, read as numpy: the value is what is checked,
    and a child that imports no torch starts in a fraction of the time."""
    return run_api(
        c,
        f"""
        import json, smoltorrent
        print(json.dumps(float(smoltorrent.load({name!r}, framework="numpy")["w"][0, 0])))
        """,
    )


def test_without_a_worker_save_returns_and_the_version_is_stored_once_one_starts(make_cluster):
    c = make_cluster(2, worker=False)
    try:
        out = run_api(
            c,
            """
            import json, os, torch, smoltorrent
            handle = smoltorrent.save({"w": torch.full((64, 64), 3.0)}, "durable/no-worker",
                                      wait=False)
            journal = os.path.join(os.environ["SMOLTORRENT_HOME"], "staging", "journal")
            try:
                handle.result(timeout=0.5)
                waited = "returned"
            except TimeoutError as e:
                waited = str(e)
            print(json.dumps({"done": handle.done(), "waited": waited, "journal": journal,
                              "journalled": len([f for f in os.listdir(journal)
                                                 if f.endswith(".json")])}))
            """,
        )
        assert (out["done"], out["journalled"]) == (False, 1)  # returned, recorded on disk
        # A bounded wait says which save, that it goes on, and where to look (issue 40).
        assert "'durable/no-worker'" in out["waited"] and "background" in out["waited"]
        assert os.path.join(out["journal"], "writer.log") in out["waited"]
        assert stored(c, "durable/no-worker", 1, timeout=3) == []
        c.start_worker()
        assert len(stored(c, "durable/no-worker", 1)) == 1
        assert current_value(c, "durable/no-worker") == 3.0
        deadline = time.monotonic() + 30
        while writer_pids(c) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert writer_pids(c) == []  # the writer ends once its saves are stored
        assert list((c.root / "staging" / "journal").glob("*.json")) == []
    finally:
        kill_writers(c)


def test_a_trainer_killed_right_after_a_second_queued_save_has_it_stored(make_cluster):
    c = make_cluster(2)
    try:
        proc = run_api(
            c,
            """
            import os, signal, torch, smoltorrent
            smoltorrent.save({"w": torch.full((256, 256), 1.0)}, "durable/queued", wait=False)
            smoltorrent.save({"w": torch.full((256, 256), 2.0)}, "durable/queued", wait=False)
            os.kill(os.getpid(), signal.SIGKILL)
            """,
            check=False,
        )
        assert proc.returncode == -signal.SIGKILL
        assert len(stored(c, "durable/queued", 2)) == 2
        assert current_value(c, "durable/queued") == 2.0  # stored in the order they were made
    finally:
        kill_writers(c)


def test_saves_whose_trainer_and_writer_were_killed_are_stored_by_the_next_save(make_cluster):
    c = make_cluster(2, worker=False)  # nothing is stored before both die
    try:
        proc = run_api(
            c,
            """
            import os, signal, time, torch, smoltorrent
            from smoltorrent import api
            smoltorrent.save({"w": torch.full((256, 256), 1.0)}, "durable/orphan", wait=False)
            smoltorrent.save({"w": torch.full((256, 256), 2.0)}, "durable/orphan", wait=False)
            time.sleep(1)  # the writer has them (it holds their records)
            (writer,) = api._writers.values()
            os.kill(writer.proc.pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
            """,
            check=False,
        )
        assert proc.returncode == -signal.SIGKILL
        c.start_worker()
        assert stored(c, "durable/orphan", 1, timeout=3) == []  # nobody holds them now
        out = run_api(
            c,
            """
            import json, torch, smoltorrent
            saved = smoltorrent.save({"w": torch.zeros(2)}, "durable/other")
            print(json.dumps(saved.size > 0))
            """,
        )
        assert out is True
        assert len(stored(c, "durable/orphan", 2)) == 2
        assert current_value(c, "durable/orphan") == 2.0
    finally:
        kill_writers(c)


def test_an_update_right_after_save_returns_never_reaches_the_stored_version(make_cluster):
    c = make_cluster(2)
    out = run_api(
        c,
        """
        import json, numpy as np, torch, smoltorrent
        w = torch.zeros(512, 512)
        a = np.zeros((64, 64), dtype=np.float32)
        h1 = smoltorrent.save({"model": {"w": w}}, "durable/inplace", wait=False)
        w.add_(1.0)  # the next optimizer step, in place, before the store has read anything
        h2 = smoltorrent.save({"a": a}, "durable/inplace-numpy", wait=False)
        a += 1.0
        h1.result(), h2.result()
        back = smoltorrent.load("durable/inplace")["model"]["w"]
        back_np = smoltorrent.load("durable/inplace-numpy", framework="numpy")["a"]
        print(json.dumps([float(back.abs().max()), float(np.abs(back_np).max())]))
        """,
    )
    assert out == [0.0, 0.0]


def test_a_store_that_fails_shows_on_the_handle_and_keeps_the_staged_file(make_cluster):
    # One back-off (1 s) before the store gives up, not four (15 s): the failure is the point.
    c = make_cluster(2, SMOLTORRENT_NO_NODE_RETRIES="1")
    for node in c.node_procs:  # no node registered: the store fails for good
        c.cli("nodes", "rm", str(node.address))
    out = run_api(
        c,
        """
        import json, os, torch, smoltorrent
        from smoltorrent.errors import SmoltorrentError
        handle = smoltorrent.save({"w": torch.ones(8)}, "durable/failed", wait=False)
        try:
            handle.result(timeout=120)
            error = None
        except SmoltorrentError as exc:
            error = str(exc)
        from prometheus_client import REGISTRY
        print(json.dumps({"error": error, "path": handle.path,
                          "kept": os.path.exists(handle.path),
                          "counted": REGISTRY.get_sample_value("smoltorrent_save_failures_total")}))
        """,
    )
    assert out["error"] is not None and out["kept"] and out["counted"] == 1.0  # in metrics too
    assert out["path"] in out["error"] and "smoltorrent store" in out["error"]
    assert list((c.root / "staging" / "journal").glob("*.json")) == []  # not retried forever


def test_saves_while_redis_is_away_return_and_are_stored_once_it_is_back(make_cluster, tmp_path):
    """README and docs/api.md: a save never raises into the training step while the cluster
    is away. With Redis SIGKILLed, five save(wait=False) calls each return a handle at
    once, nothing raises; once Redis is back, every handle reports its version stored."""
    c = make_cluster(3)
    go = tmp_path / "redis-is-back"
    script = f"""
        import json, os, sys, time, torch, smoltorrent
        handles = []
        for step in range(5):
            handles.append(smoltorrent.save({{"w": torch.full((8, 8), float(step))}},
                                            "durable/outage", wait=False))
        print("saved", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.1)
        print(json.dumps([h.result(timeout=180).version_id for h in handles]))
        """
    c.kill_redis()
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=c.env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None
        first = trainer.stdout.readline()  # every save returned, or the trainer raised
        assert first.strip() == "saved", trainer.stderr.read() if trainer.stderr else first
        c.start_redis()
        go.touch()
        out, err = trainer.communicate(timeout=240)
    finally:
        trainer.kill()
    assert trainer.returncode == 0, err
    versions = json.loads(out.strip().splitlines()[-1])
    assert len(set(versions)) == 5
    assert float(current_value(c, "durable/outage")) == 4.0


def test_the_writer_gives_up_after_an_hour_and_the_journal_keeps_the_save(make_cluster, tmp_path):
    """docs/api.md: with the cluster away, the writer retries every 2 s for up to an hour
    (SAVE_PATIENCE_S); then handle.result() raises, and the save stays journalled for the
    next save or load on this machine. The hour passes at once: the trainer and its writer
    run under libfaketime, whose offset (monotonic clock included) a file sets."""
    if not os.path.exists(FAKETIME_LIB):
        pytest.skip("libfaketime is not installed (Debian: faketime)")
    c = make_cluster(2)
    clock = tmp_path / "faketime"
    clock.write_text("+0\n")
    script = """
        import json, torch, smoltorrent
        from smoltorrent.errors import SmoltorrentError
        handle = smoltorrent.save({"w": torch.ones(8, 8)}, "durable/patience", wait=False)
        print("saved", flush=True)
        try:
            handle.result()
            print(json.dumps(None))
        except SmoltorrentError as exc:
            print(json.dumps(str(exc)))
        """
    c.kill_redis()
    env = dict(
        c.env(),
        LD_PRELOAD=FAKETIME_LIB,
        FAKETIME_TIMESTAMP_FILE=str(clock),
        FAKETIME_NO_CACHE="1",
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "saved"
        time.sleep(2 * defaults.SAVE_RETRY_S)  # the writer has tried, and waits to again
        clock.write_text(f"+{int(defaults.SAVE_PATIENCE_S) + 60}\n")
        out, err = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
    error = json.loads(out.strip().splitlines()[-1])
    assert error is not None and "durable/patience is not stored" in error, err
    assert "journalled" in error
    assert len(list((c.root / "staging" / "journal").glob("*.json"))) == 1
