"""A node whose disk fails a system call (EIO, injected with libfiu in the node process
itself): the put that met it fails with an error the sender can act on, leaves no trace,
and the node goes on serving what it holds and the puts after it."""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.local.cluster import NodeProcess
from smoltorrent.errors import NodeError
from tests.conftest import require_libfiu
from tests.worker_server.conftest import CLUSTER_KEY, SourceBlob

FSYNC = "posix/io/sync/fsync"
# libfiu's failure points (fiu-utils' function_list). A blob's bytes reach its temp file
# with pwrite(2): the node's sockets are written with write(2), which an injected write
# error would break too, and a disk error must not look like a dead link.
PWRITE = "posix/io/rw/pwrite"
RENAME = "posix/io/dir/rename"


def fiu_ctrl(pid: int, command: str) -> None:
    subprocess.run(["fiu-ctrl", "-c", command, str(pid)], check=True, timeout=10)


@pytest.fixture
def fiu_node(tmp_path: Path) -> Iterator[NodeProcess]:
    require_libfiu()
    node = NodeProcess(tmp_path / "node", CLUSTER_KEY, launcher=("fiu-run", "-x")).start()
    yield node
    node.kill()


@pytest.mark.parametrize("point", [FSYNC, PWRITE, RENAME])
def test_eio_on_fsync_write_or_rename_fails_that_put_only(
    fiu_node: NodeProcess, make_blob, point: str
) -> None:
    kept: SourceBlob = make_blob(512 * 1024)
    assert kept.put(fiu_node.client()) is True

    fiu_ctrl(fiu_node.pid, f"enable name={point},failinfo={errno.EIO}")
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
    fiu_ctrl(fiu_node.pid, f"disable name={point}")
    assert bad.put(fiu_node.client()) is True
    assert fiu_node.client().has([bad.digest]) == {bad.digest}


@pytest.mark.parametrize("point", [FSYNC, RENAME])
def test_eio_while_publishing_a_manifest_is_answered_as_a_disk_error(
    fiu_node: NodeProcess, point: str
) -> None:
    manifest = json.dumps({"name": "run/latest.safetensors"}).encode()
    fiu_ctrl(fiu_node.pid, f"enable name={point},failinfo={errno.EIO}")
    with pytest.raises(NodeError) as failed:
        fiu_node.client().put_manifest("v1", manifest)
    # An answer, not a dropped connection: the commit retries or uses the other holders.
    assert failed.value.code == "disk_error", failed.value
    assert "check the disk" in str(failed.value)
    assert list((fiu_node.data_dir / "tmp").iterdir()) == []

    fiu_ctrl(fiu_node.pid, f"disable name={point}")
    fiu_node.client().put_manifest("v1", manifest)
    assert fiu_node.client().get_manifest("v1") == manifest


def test_eio_while_deleting_is_answered_as_a_disk_error(fiu_node: NodeProcess, make_blob) -> None:
    """Found by a fault run (bench.chaos seed 22): a delete whose directory fsync failed
    dropped the connection, which the remove read as a node that stopped answering."""
    blob: SourceBlob = make_blob(64 * 1024)
    assert blob.put(fiu_node.client()) is True
    fiu_node.client().put_manifest("v1", b"{}")
    fiu_ctrl(fiu_node.pid, f"enable name={FSYNC},failinfo={errno.EIO}")
    for delete in (lambda c: c.delete(blob.digest), lambda c: c.delete_manifest("v1")):
        with pytest.raises(NodeError) as failed:
            delete(fiu_node.client())
        assert failed.value.code == "disk_error", failed.value
    fiu_ctrl(fiu_node.pid, f"disable name={FSYNC}")
    # Asked again (the remove retries), the node answers: the file is gone.
    assert fiu_node.client().delete(blob.digest) is False
    assert fiu_node.client().delete_manifest("v1") is False
