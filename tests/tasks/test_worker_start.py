"""`smoltorrent worker &` and then a store at once, as the README's steps read: the store
waited for nothing and failed, "no smoltorrent worker is serving this host", because the
worker's Celery boot (seconds) had not sent its first heartbeat. A worker that says it is
starting is waited for."""

from __future__ import annotations

from tests.tasks.test_control_plane import make_ckpt, sha


def test_a_store_right_after_the_worker_starts_waits_for_it(make_cluster, tmp_path):
    c = make_cluster(2, worker=False)
    src = make_ckpt(tmp_path / "early.safetensors", 1_000_000)
    c.spawn_worker()  # not waited for
    stored = c.cli("store", str(src), "--replicas", "2", check=False)
    assert stored.returncode == 0, stored.stdout + stored.stderr
    assert not c.md.nodes.worker_is_starting(c.host_id)  # its heartbeat took over
    out = tmp_path / "back.safetensors"
    c.cli("gather", "early.safetensors", "-o", str(out))
    assert sha(out) == sha(src)


def test_with_no_worker_starting_a_store_still_fails_at_once_with_the_fix(make_cluster, tmp_path):
    c = make_cluster(1, worker=False)
    src = make_ckpt(tmp_path / "none.safetensors", 100_000)
    stored = c.cli("store", str(src), "--replicas", "1", check=False, timeout=30)
    assert stored.returncode == 1
    assert "no smoltorrent worker is serving this host" in stored.stderr
    assert "smoltorrent worker" in stored.stderr
