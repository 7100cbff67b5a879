"""Chunk planning: boundaries follow tensors, so unchanged tensors keep their chunks."""

from __future__ import annotations

import hashlib
import os
import shutil
import struct

import pytest

from coordinator.local.synthetic import write_checkpoint
from coordinator.plan.chunks import ChunkPlan, grouping_width, plan_chunks
from coordinator.plan.safetensors_header import CheckpointHeader, parse_header, read_header
from tests.checkpoints import raw_file_bytes, write_llm_like

KIB = 1024


def header_of(tensors: list[tuple[str, str, int]]) -> CheckpointHeader:
    """A header whose tensors (name, dtype, byte size) follow each other in this order."""
    entries, offset = {}, 0
    for name, dtype, size in tensors:
        item = max(1, grouping_width(dtype))
        entries[name] = {
            "dtype": dtype,
            "shape": [size // item],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    content = raw_file_bytes(entries, bytes(offset))
    (length,) = struct.unpack("<Q", content[:8])
    return parse_header(content[:8], content[8 : 8 + length], len(content))


def ranges(plans: list[ChunkPlan]) -> list[tuple[int, int]]:
    return [(p.data_start, p.data_end) for p in plans]


def check_tiling(header: CheckpointHeader, plans: list[ChunkPlan], target: int) -> None:
    assert [p.index for p in plans] == list(range(len(plans)))
    ends = [p.data_end for p in plans]
    assert [p.data_start for p in plans] == [0, *ends[:-1]]
    assert (plans[-1].data_end if plans else 0) == header.data_size
    for plan in plans:
        assert 0 < plan.size <= target
        assert sum(length for length, _ in plan.layout) == plan.size


@pytest.mark.parametrize(
    ("dtype", "width"),
    [("BF16", 2), ("F16", 2), ("F32", 4), ("F64", 8), ("I64", 8), ("C64", 4), ("U8", 1)]
    + [("BOOL", 1), ("F8_E4M3", 1), ("F4", 1), ("F6_E2M3", 1), ("I16", 2), ("U32", 4)],
)
def test_grouping_width_is_the_element_size(dtype: str, width: int) -> None:
    assert grouping_width(dtype) == width


def test_big_tensors_stand_alone_and_small_ones_pack_up_to_the_target() -> None:
    header = header_of(
        [
            ("norm0", "F32", 4 * KIB),
            ("bias0", "BF16", 2 * KIB),
            ("q", "BF16", 64 * KIB),  # = solo: its own chunk
            ("norm1", "F32", 30 * KIB),
            ("norm2", "F32", 30 * KIB),
            ("norm3", "F32", 10 * KIB),  # 70 KiB would pass the 64 KiB target: a new run
            ("up", "BF16", 150 * KIB),  # over the target: cut at 64 KiB from its start
            ("step", "I64", 8),
        ]
    )
    plans = plan_chunks(header, target=64 * KIB, solo=64 * KIB)
    check_tiling(header, plans, 64 * KIB)
    by_name = {t.name: t for t in header.tensors}
    up = by_name["up"].start
    assert ranges(plans) == [
        (0, 6 * KIB),
        (6 * KIB, 70 * KIB),
        (70 * KIB, 130 * KIB),
        (130 * KIB, 140 * KIB),
        (up, up + 64 * KIB),
        (up + 64 * KIB, up + 128 * KIB),
        (up + 128 * KIB, up + 150 * KIB),
        (up + 150 * KIB, up + 150 * KIB + 8),
    ]
    assert plans[0].layout == ((4 * KIB, 4), (2 * KIB, 2))
    assert plans[2].layout == ((60 * KIB, 4),)  # two F32 neighbours, one run
    assert plans[5].layout == ((64 * KIB, 2),)
    assert plans[7].layout == ((8, 8),)


def test_zero_size_tensors_are_in_no_chunk_and_an_empty_data_section_has_none() -> None:
    header = header_of([("a", "F32", 0), ("b", "F32", 16), ("c", "BOOL", 0), ("d", "U8", 3)])
    assert ranges(plan_chunks(header, 64 * KIB, 64 * KIB)) == [(0, 19)]
    assert plan_chunks(header_of([("a", "F32", 0)]), 64 * KIB, 64 * KIB) == []


def test_a_real_mixed_checkpoint_tiles_with_each_dtype_grouped(tmp_path) -> None:
    path = tmp_path / "llm.safetensors"
    write_llm_like(path, layers=4, hidden=128)
    header = read_header(path)
    plans = plan_chunks(header, target=32 * KIB, solo=8 * KIB)
    check_tiling(header, plans, 32 * KIB)
    for tensor in header.tensors:
        for plan in plans:
            offset = plan.data_start
            for length, width in plan.layout:
                overlap = min(tensor.end, offset + length) - max(tensor.start, offset)
                if overlap > 0:
                    assert width == grouping_width(tensor.dtype), tensor.name
                offset += length


def test_a_bad_target_is_refused() -> None:
    header = header_of([("a", "U8", 10)])
    for target, solo in ((64, 128), (100, 50), (64, 0)):
        with pytest.raises(ValueError, match="do not fit together"):
            plan_chunks(header, target, solo)


def test_a_tensor_that_grows_moves_no_big_tensor_s_chunk() -> None:
    before = header_of([("a", "F32", 4 * KIB), ("big", "BF16", 100 * KIB), ("c", "U8", 7)])
    after = header_of([("a", "F32", 12 * KIB), ("big", "BF16", 100 * KIB), ("c", "U8", 7)])
    for header in (before, after):
        big = next(t for t in header.tensors if t.name == "big")
        plans = plan_chunks(header, target=64 * KIB, solo=16 * KIB)
        assert (big.start, big.start + 64 * KIB) in ranges(plans)
        assert (big.start + 64 * KIB, big.end) in ranges(plans)


def _chunk_digests(path: os.PathLike, plans: list[ChunkPlan], data_start: int) -> list[str]:
    with open(path, "rb") as f:
        out = []
        for plan in plans:
            f.seek(data_start + plan.data_start)
            out.append(hashlib.sha256(f.read(plan.size)).hexdigest())
    return out


def test_a_fine_tune_of_one_matrix_per_layer_reuses_every_other_chunk(tmp_path) -> None:
    """Version 2 changes q_proj in every layer (about 8% of the bytes, spread over the
    whole file); every chunk of version 2 that holds no q_proj byte is one version 1
    already has, and the chunks that changed hold nothing but q_proj bytes."""
    first, second = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    write_checkpoint(first, 12 * 1024 * 1024, hidden=256)  # q_proj 128 KiB, gate 384 KiB
    shutil.copyfile(first, second)
    header = read_header(first)
    changed = [t for t in header.tensors if t.name.endswith("self_attn.q_proj.weight")]
    with open(second, "r+b") as f:
        for tensor in changed:
            f.seek(header.data_start + tensor.start)
            f.write(os.urandom(tensor.size))
    assert len(changed) >= 4
    assert read_header(second).header_bytes == header.header_bytes

    plans = plan_chunks(header, target=256 * KIB, solo=64 * KIB)  # gate/up/down cut in two
    check_tiling(header, plans, 256 * KIB)
    old = _chunk_digests(first, plans, header.data_start)
    new = _chunk_digests(second, plans, header.data_start)
    moved = [p for p, a, b in zip(plans, old, new, strict=True) if a != b]
    assert ranges(moved) == [(t.start, t.end) for t in changed]
    assert set(new) - set(old) == {new[p.index] for p in moved}
    moved_bytes = sum(p.size for p in moved)
    assert moved_bytes == sum(t.size for t in changed)
    assert moved_bytes / header.data_size < 0.1
