"""`smoltorrent watch` as a real process against a real cluster: a slow writer, a
rename into place, rewrites, junk, the directory vanishing, a kill and a restart."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from celery import Celery

from coordinator.local.synthetic import write_checkpoint
from coordinator.state.versions import COMMITTED
from coordinator.watcher import checkpoint_name
from tests.tasks.conftest import make_cluster, wait_until  # noqa: F401 (fixture)

MiB = 1024 * 1024

# Writes SRC into DST in 1 MiB chunks spread over SECONDS, as a slow training save does.
SLOW_WRITER = textwrap.dedent(
    """
    import os, sys, time
    src, dst, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    data = open(src, "rb").read()
    chunks = [data[i : i + 1048576] for i in range(0, len(data), 1048576)]
    with open(dst, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            f.flush()
            time.sleep(seconds / len(chunks))
    """
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class WatchProcess:
    def __init__(self, cluster, directory: Path, log: Path) -> None:
        self.cluster, self.directory, self.log_path = cluster, directory, log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "watch", str(directory)]
                + ["--name-prefix", "run1"],
                env=cluster.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def queued(self, name: str) -> list[str]:
        """Task ids of the stores this watcher queued for `name`, in order."""
        return [
            line.rsplit("task=", 1)[1]
            for line in self.log().splitlines()
            if f"event=queued name={name} " in line
        ]


def versions(cluster, name: str) -> list[dict]:
    return [v for v in cluster.cli_json("ls") if v["name"] == name]


def committed_sha(cluster, tmp_path: Path, name: str) -> str:
    out = tmp_path / "gathered.safetensors"
    cluster.cli("gather", name, "-o", str(out))
    digest = sha(out)
    out.unlink()
    return digest


def store_result(cluster, task_id: str) -> dict:
    app = Celery(broker=cluster.redis_url, backend=cluster.redis_url)
    try:
        return app.AsyncResult(task_id).get(timeout=120)
    finally:
        app.close()


def test_checkpoint_name_is_the_path_under_the_root(tmp_path):
    assert checkpoint_name(tmp_path, tmp_path / "a/b.safetensors") == "a/b.safetensors"
    assert checkpoint_name(tmp_path, tmp_path / "b.safetensors", "run1/") == "run1/b.safetensors"
    assert checkpoint_name(tmp_path, tmp_path / "b.safetensors", "run1") == "run1/b.safetensors"


@pytest.mark.timeout(600)
def test_watcher_stores_complete_checkpoints_only(make_cluster, tmp_path):  # noqa: F811
    c = make_cluster(4)
    root = tmp_path / "ckpts"
    root.mkdir()
    log = tmp_path / "watch.log"
    w = WatchProcess(c, root, log)
    try:
        wait_until(lambda: "watching " in w.log(), 60, what="the watcher to start")
        # 1. A checkpoint written in place in 1 MiB chunks over ~6 s (three times the 2 s a
        # file must stay unchanged, a chunk every 0.4 s): stored once, complete.
        src = tmp_path / "slow.src"
        write_checkpoint(src, 14 * MiB, hidden=512)
        writer = subprocess.Popen(
            [sys.executable, "-c", SLOW_WRITER, str(src), str(root / "slow.safetensors"), "6"]
        )
        # 2. Meanwhile, junk and a file that is not a checkpoint at all.
        (root / "junk.safetensors").write_bytes(os.urandom(4096))
        (root / "notes.txt").write_text("lr=3e-4")
        write_checkpoint(root / "tab\there.safetensors", MiB, hidden=128)  # a name refused
        assert writer.wait(timeout=120) == 0
        name = "run1/slow.safetensors"
        wait_until(lambda: [v for v in versions(c, name) if v["state"] == COMMITTED], 120)
        # Never a version of a partial file: one version, and it is the whole file.
        assert len(versions(c, name)) == 1
        assert committed_sha(c, tmp_path, name) == sha(src)

        # 3. The save-to-temp-then-rename pattern.
        tmp = root / ".model.safetensors.tmp"
        write_checkpoint(tmp, 2 * MiB, hidden=256)
        first_content = tmp.read_bytes()
        os.rename(tmp, root / "model.safetensors")
        name = "run1/model.safetensors"
        wait_until(lambda: [v for v in versions(c, name) if v["state"] == COMMITTED], 120)
        assert len(versions(c, name)) == 1

        # 4. Rewritten in place with new content: a second version, now current.
        write_checkpoint(root / "model.safetensors", 2 * MiB, hidden=256)
        new_sha = sha(root / "model.safetensors")
        wait_until(lambda: len([v for v in versions(c, name) if v["state"] == COMMITTED]) == 2)
        assert committed_sha(c, tmp_path, name) == new_sha

        # 5. Rewritten with the same content: queued again, and nothing new stored.
        (root / "model.safetensors").write_bytes(first_content)
        wait_until(lambda: len(w.queued(name)) == 3, 120, what="the third store of model")
        assert store_result(c, w.queued(name)[-1])["new"] is False
        assert len(versions(c, name)) == 2

        # Junk and the text file were logged once each, never stored, and the watcher lives.
        assert w.log().count("not storing " + str(root / "junk.safetensors")) == 1
        assert w.log().count("ignoring " + str(root / "notes.txt")) == 1
        assert not versions(c, "run1/junk.safetensors")
        assert w.log().count("not storing " + str(root / "tab\there.safetensors")) == 1
        assert w.proc.poll() is None

        # 6. The directory vanishes and comes back with a checkpoint in it.
        shutil.move(root, tmp_path / "ckpts.gone")
        wait_until(lambda: "is gone; waiting" in w.log(), 60, what="the vanished directory")
        root.mkdir()
        write_checkpoint(root / "back.safetensors", MiB, hidden=128)
        wait_until(
            lambda: [v for v in versions(c, "run1/back.safetensors") if v["state"] == COMMITTED],
            120,
        )

        # 7. Killed; checkpoints written while it is down are stored when it restarts,
        # and one already stored and unchanged is not queued again.
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait()
        (root / "sub").mkdir()
        write_checkpoint(root / "sub" / "while_down.safetensors", MiB, hidden=128)
        w = WatchProcess(c, root, tmp_path / "watch2.log")
        wait_until(
            lambda: [
                v for v in versions(c, "run1/sub/while_down.safetensors") if v["state"] == COMMITTED
            ],
            120,
        )
        assert w.queued("run1/back.safetensors") == []
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(timeout=30) == 0
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


@pytest.mark.timeout(600)
def test_a_hugging_face_directory_is_stored_as_one_unit(make_cluster, tmp_path):  # noqa: F811
    from tests.checkpoints import write_hf_dir

    def digests(root: Path) -> dict[str, str]:
        return {f.name: sha(f) for f in sorted(root.iterdir()) if f.name != "config.json"}

    def stored(w: WatchProcess) -> int:
        return w.log().count("event=stored-directory name=run1/llama ")

    c = make_cluster(3)
    root = tmp_path / "ckpts"
    root.mkdir()
    w = WatchProcess(c, root, tmp_path / "watch.log")
    try:
        wait_until(lambda: "watching " in w.log(), 60, what="the watcher to start")
        # save_pretrained writes the parts, then the index, then config.json, in place.
        write_hf_dir(root / "llama")
        wait_until(lambda: stored(w) == 1, 180, what="the directory stored as one unit")
        out = tmp_path / "restored"
        c.cli("gather", "run1/llama", "-o", str(out))
        assert digests(out) == digests(root / "llama")

        # One part rewritten with new weights: a new version of the whole directory.
        staging = tmp_path / "staging"
        write_hf_dir(staging, seed=1)
        part = "model-00001-of-00003.safetensors"
        shutil.copyfile(staging / part, root / "llama" / part)
        wait_until(lambda: stored(w) == 2, 180, what="the rewritten directory stored")
        out2 = tmp_path / "restored2"
        c.cli("gather", "run1/llama", "-o", str(out2))
        assert digests(out2) == digests(root / "llama") != digests(out)
        assert "not storing" not in w.log() and w.proc.poll() is None
    finally:
        w.proc.kill()
        w.proc.wait()
