"""A node whose disk fails a system call (EIO, injected with libfiu in the node process
itself): the put that met it fails with an error the sender can act on, leaves no trace,
and the node goes on serving what it holds and the puts after it."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.cluster import NodeProcess
from smoltorrent.errors import NodeError
from tests.conftest import require_libfiu
from tests.worker_server.conftest import CLUSTER_KEY, SourceBlob

FSYNC = "posix/io/sync/fsync"


def fiu_ctrl(pid: int, command: str) -> None:
    subprocess.run(["fiu-ctrl", "-c", command, str(pid)], check=True, timeout=10)


@pytest.fixture
def fiu_node(tmp_path: Path) -> Iterator[NodeProcess]:
    require_libfiu()
    node = NodeProcess(tmp_path / "node", CLUSTER_KEY, launcher=("fiu-run", "-x")).start()
    yield node
    node.kill()


def test_eio_on_fsync_fails_that_put_only(fiu_node: NodeProcess, make_blob) -> None:
    kept: SourceBlob = make_blob(512 * 1024)
    assert kept.put(fiu_node.client()) is True

    fiu_ctrl(fiu_node.pid, f"enable name={FSYNC},failinfo={errno.EIO}")
    bad: SourceBlob = make_blob(512 * 1024)
    with pytest.raises(NodeError) as failed:
        bad.put(fiu_node.client())
    # An answer that names the disk (the connection used to drop, read as "node stopped
    # answering: check that it is running"), with a code the chain engine replaces on.
    assert failed.value.code == "disk_error", failed.value
    assert "Input/output error" in str(failed.value) and "check the disk" in str(failed.value)
    assert list((fiu_node.data_dir / "tmp").iterdir()) == []
    assert fiu_node.is_running()

    # It still serves what it holds, and the same put once the disk answers again.
    client = fiu_node.client()
    assert client.has([kept.digest, bad.digest]) == {kept.digest}
    fiu_ctrl(fiu_node.pid, f"disable name={FSYNC}")
    assert bad.put(fiu_node.client()) is True
    assert fiu_node.client().has([bad.digest]) == {bad.digest}
