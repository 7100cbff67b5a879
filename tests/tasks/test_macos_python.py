"""Store, gather and load on a Python that lacks what macOS's Python lacks.

The coordinator of the original system is a Mac. Every process of a real local cluster
here (the CLI, the Celery worker and its pool children, the nodes, a training script)
starts with tests/macos_python first on PYTHONPATH: its sitecustomize removes the
Linux-only calls from os, socket, fcntl and select and hides /proc, before anything
else is imported. A call without a fallback then fails here as it would on a Mac.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from coordinator.local.synthetic import write_checkpoint
from tests.macos_python import mac_pythonpath

TIMEOUT_S = 120.0  # seconds for one process on a loaded box


PROBE = """
import os, socket, select
try:
    proc = bool(open("/proc/self/stat"))
except FileNotFoundError:
    proc = False
print(hasattr(os, "posix_fallocate"), hasattr(socket, "TCP_INFO"), hasattr(select, "epoll"), proc)
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_store_gather_and_load_without_the_linux_only_calls(make_cluster, tmp_path: Path):
    fsyncs = tmp_path / "fsync.log"
    cluster = make_cluster(PYTHONPATH=mac_pythonpath(), SMOLTORRENT_TEST_FSYNC_LOG=str(fsyncs))
    env = cluster.env()
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert probe.stdout.split() == ["False"] * 4, probe.stderr  # the shim is in force

    src = tmp_path / "mac.safetensors"
    write_checkpoint(src, 3 * 1024 * 1024, hidden=128)
    cluster.cli("store", str(src))

    out = tmp_path / "restored.safetensors"
    cluster.cli("gather", "mac.safetensors", "-o", str(out))
    assert sha(out) == sha(src)

    script = (
        "import sys, smoltorrent\n"
        "from smoltorrent.tensors import read_file\n"
        "want = read_file(sys.argv[1], 'numpy')\n"
        "got = smoltorrent.load('mac.safetensors', framework='numpy')\n"
        "assert got.keys() == want.keys(), (sorted(got), sorted(want))\n"
        "assert all(got[k].tobytes() == want[k].tobytes() for k in want)  # NaNs too\n"
        "part = smoltorrent.load('mac.safetensors', framework='numpy', tensors=[sys.argv[2]])\n"
        "assert list(part) == [sys.argv[2]]\n"
        "assert part[sys.argv[2]].tobytes() == want[sys.argv[2]].tobytes()\n"
        "import numpy\n"
        "state = {'w': numpy.arange(12, dtype=numpy.float32).reshape(3, 4)}\n"
        "smoltorrent.save(state, 'mac/api')\n"
        "back = smoltorrent.load('mac/api', framework='numpy')\n"
        "assert back['w'].tobytes() == state['w'].tobytes(), back\n"
        "print('loaded', len(got))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", script, str(src), "lm_head.weight"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    assert loaded.stdout.startswith("loaded ")
    assert "AttributeError" not in cluster.worker_log()

    # Every durable write asked for F_FULLFSYNC, which a Mac's fsync(2) does not do: the
    # nodes' blobs and manifests, the gathered file, the trainer's journal and snapshot.
    kinds: dict[str, set[int]] = {}
    for line in fsyncs.read_text().splitlines():
        pid, kind = line.split()
        kinds.setdefault(kind, set()).add(int(pid))
    assert "plain" not in kinds, kinds
    assert {n.pid for n in cluster.node_procs} <= kinds["full"], kinds
    assert len(kinds["full"]) > len(cluster.node_procs), kinds  # the gatherers' and trainer's
