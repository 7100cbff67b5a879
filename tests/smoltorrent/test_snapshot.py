"""The snapshot a save takes and the file its writer makes of it, without a cluster: the
same bytes the framework's own safetensors writer writes, and none of an update made
after the snapshot."""

from __future__ import annotations

import os
import stat
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from smoltorrent import defaults
from smoltorrent.keypaths import STATE_KEY, flatten
from smoltorrent.snapshot import Pool, _layout, _snapshot
from smoltorrent.snapshot_writer import _serialize


def written(state, tmp_path: Path, metadata=None, pool=None, job=None):
    """The file the writer makes of the state's snapshot, and the snapshot's buffer."""
    flat = flatten(state)
    header = dict(metadata or {})
    if flat.structure is not None:
        header[STATE_KEY] = flat.structure
    layout = _layout(flat)
    assert layout is not None
    job = job or uuid.uuid4().hex  # the shared-memory directory is shared by parallel tests
    buffer = _snapshot(flat, layout, tmp_path, job, pool or Pool())
    out = tmp_path / f"{job}.safetensors"
    _serialize(str(buffer.path), layout, header or None, str(out))
    return out.read_bytes(), buffer


def test_a_flat_torch_state_dict_gives_the_bytes_safetensors_writes(tmp_path):
    embed = torch.randn(16, 8)
    sd = {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "fp8": torch.linspace(-2, 2, 9).to(torch.float8_e4m3fn),
        "transposed": torch.randn(3, 4).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "flags": torch.tensor([True, False]),
        "rows": embed[2:4],
    }
    data, buffer = written(sd, tmp_path, {"step": "3"})
    expected = {k: v.contiguous() for k, v in sd.items()}
    assert data == safetensors.torch.save(expected, metadata={"step": "3"})
    buffer.close(unlink=True)


def test_a_flat_numpy_state_dict_gives_the_bytes_safetensors_writes(tmp_path):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    sd = {"f32": a, "bf16": a.astype(ml_dtypes.bfloat16), "fortran": np.asfortranarray(a)}
    data, buffer = written(sd, tmp_path)
    assert data == safetensors.numpy.save({k: np.ascontiguousarray(v) for k, v in sd.items()})
    buffer.close(unlink=True)


def test_an_update_after_the_snapshot_never_reaches_the_file(tmp_path):
    w = torch.zeros(256, 256)
    flat = flatten({"model": {"w": w}, "step": 1})
    layout = _layout(flat)
    buffer = _snapshot(flat, layout, tmp_path, uuid.uuid4().hex, Pool())
    w.add_(1)  # the next training step, before the writer has written anything
    out = tmp_path / "out.safetensors"
    _serialize(str(buffer.path), layout, None, str(out))
    assert torch.equal(safetensors.torch.load_file(out)["model/w"], torch.zeros(256, 256))
    buffer.close(unlink=True)


def test_a_kept_buffer_serves_the_next_smaller_snapshot_with_only_its_bytes(tmp_path):
    pool = Pool()
    big = {"w": torch.full((64, 64), 7.0), "v": torch.ones(100)}
    _, first = written(big, tmp_path, pool=pool)
    old = first.path
    pool.put(first)  # the writer has staged it
    small = {"w": torch.arange(10.0)}
    job = uuid.uuid4().hex
    data, second = written(small, tmp_path, pool=pool, job=job)
    assert second is first and second.path.name == f"{job}.snapshot"  # the same pages, renamed
    assert not old.exists()
    assert data == safetensors.torch.save(small)  # nothing of the bigger state left in it
    second.close(unlink=True)


def _squatted(tmp_path: Path, monkeypatch, make) -> tuple[Path, Path]:
    """A shared-memory folder whose smoltorrent-UID entry another local user made first
    (`make(path)`), and the staging directory a save falls back to."""
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o1777)
    monkeypatch.setattr(defaults, "SNAPSHOT_SHM_DIR", str(shm))
    make(shm / f"smoltorrent-{os.getuid()}")
    staging = tmp_path / "staging"
    staging.mkdir()
    return shm, staging


def _squat_dir(path: Path) -> None:
    path.mkdir(mode=0o777)
    os.chmod(path, 0o777)
    os.chown(path, 65534, 65534)  # nobody: another local user


def _squat_link(path: Path) -> None:
    target = path.parent / "elsewhere"
    target.mkdir(mode=0o777)
    path.symlink_to(target)


@pytest.mark.parametrize("make", [_squat_dir, _squat_link], ids=["other-owner", "symlink"])
def test_a_squatted_shared_memory_directory_is_never_used(tmp_path, monkeypatch, make):
    """Another local user who made /dev/shm/smoltorrent-UID first (or a link there) could
    swap a snapshot, or make the save raise into the training step: the save takes its
    snapshot in the staging directory instead, and still gives the same bytes."""
    if make is _squat_dir and os.getuid() != 0:
        pytest.skip("making a directory owned by another user needs root (CI runs as root)")
    shm, staging = _squatted(tmp_path, monkeypatch, make)
    sd = {"w": torch.randn(4, 4)}
    data, buffer = written(sd, staging)
    assert buffer.path.parent == staging / ".snapshots"
    assert data == safetensors.torch.save(sd)
    buffer.close(unlink=True)
    assert [p.name for p in shm.rglob("*") if p.is_file()] == []


def test_an_own_shared_memory_directory_others_could_write_is_made_private(tmp_path, monkeypatch):
    def loose(path: Path) -> None:
        path.mkdir()
        os.chmod(path, 0o777)

    shm, staging = _squatted(tmp_path, monkeypatch, loose)
    data, buffer = written({"w": torch.ones(3)}, staging)
    assert buffer.path.parent == shm / f"smoltorrent-{os.getuid()}"
    assert stat.S_IMODE(os.lstat(buffer.path.parent).st_mode) == 0o700
    buffer.close(unlink=True)
