"""Shard planning: optimal contiguous partitions whose blobs load as safetensors files."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import struct

import pytest
import torch
from safetensors import safe_open

from coordinator.plan.planner import ShardPlan, plan_shards
from coordinator.plan.safetensors_header import CheckpointHeader, parse_header, read_header
from tests.checkpoints import (
    llm_like_tensors,
    raw_file_bytes,
    write_llm_like,
    write_mlx,
    write_one_giant,
)


def header_of_sizes(sizes: list[int]) -> CheckpointHeader:
    """A U8 checkpoint whose tensors t000, t001... have these byte sizes, in this order."""
    entries, offset = {}, 0
    for position, size in enumerate(sizes):
        entries[f"t{position:03d}"] = {
            "dtype": "U8",
            "shape": [size],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    content = raw_file_bytes(entries, bytes(offset))
    (length,) = struct.unpack("<Q", content[:8])
    return parse_header(content[:8], content[8 : 8 + length], len(content))


def group_sizes(plans: list[ShardPlan]) -> list[int]:
    return [plan.data_size for plan in plans]


def brute_force_best_max(sizes: list[int], groups: int) -> int:
    best = sum(sizes)
    for cuts in itertools.combinations(range(1, len(sizes)), groups - 1):
        bounds = [0, *cuts, len(sizes)]
        best = min(best, max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def assert_is_partition(header: CheckpointHeader, plans: list[ShardPlan]) -> None:
    assert [plan.index for plan in plans] == list(range(len(plans)))
    assert [name for plan in plans for name in plan.tensors] == [t.name for t in header.tensors]
    assert plans[0].data_start == 0 and plans[-1].data_end == header.data_size
    for before, after in itertools.pairwise(plans):
        assert before.data_end == after.data_start
    assert all(plan.tensors for plan in plans)


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(7)
    for _ in range(150):
        sizes = [rng.choice([0, 1, 2, 3, 5, 8, 13, 40, 100]) for _ in range(rng.randint(1, 9))]
        header = header_of_sizes(sizes)
        for wanted in range(1, len(sizes) + 2):
            plans = plan_shards(header, wanted)
            assert len(plans) == min(wanted, len(sizes))
            assert_is_partition(header, plans)
            assert max(group_sizes(plans)) == brute_force_best_max(sizes, len(plans)), (
                sizes,
                wanted,
            )


def test_equal_tensors_split_evenly():
    assert group_sizes(plan_shards(header_of_sizes([10] * 12), 4)) == [30, 30, 30, 30]
    assert group_sizes(plan_shards(header_of_sizes([10] * 6), 4)) == [
        10,
        20,
        10,
        20,
    ]  # ties go to the smaller shard


def test_small_shards_stay_balanced_beside_a_giant():
    assert group_sizes(plan_shards(header_of_sizes([100, 1, 1, 1, 1]), 3)) == [100, 2, 2]


def test_planning_is_deterministic_and_ignores_json_key_order():
    sizes = [7, 0, 3, 3, 0, 9, 1, 4]
    header = header_of_sizes(sizes)
    plans = plan_shards(header, 3)
    assert plans == plan_shards(header, 3)
    entries = json.loads(header.header_bytes)
    shuffled = dict(reversed(list(entries.items())))
    content = raw_file_bytes(shuffled, bytes(sum(sizes)))
    (length,) = struct.unpack("<Q", content[:8])
    reordered = parse_header(content[:8], content[8 : 8 + length], len(content))
    assert plan_shards(reordered, 3) == plans


def test_shard_count_is_clamped_to_the_tensor_count():
    header = header_of_sizes([5, 6, 7])
    assert len(plan_shards(header, 10)) == 3
    assert len(plan_shards(header, 0)) == 1
    assert plan_shards(header_of_sizes([]), 4) == []


def test_zero_size_tensors_only():
    plans = plan_shards(header_of_sizes([0, 0, 0]), 2)
    assert [plan.tensors for plan in plans] == [("t000",), ("t001", "t002")]
    assert all(plan.data_size == 0 for plan in plans)


def test_one_giant_tensor_gets_a_shard_of_its_own(tmp_path):
    path = tmp_path / "giant.safetensors"
    write_one_giant(path)
    header = read_header(path)
    plans = plan_shards(header, 4)
    giant = next(t for t in header.tensors if t.name == "embed.weight")
    assert plans[0].tensors == ("embed.weight",) or plans[-1].tensors == ("embed.weight",)
    assert max(group_sizes(plans)) == giant.size
    assert len(plans) == 4


def write_blob(tmp_path, source: bytes, header: CheckpointHeader, plan: ShardPlan):
    start = header.data_start + plan.data_start
    blob = plan.prefix + source[start : header.data_start + plan.data_end]
    assert len(blob) == plan.blob_size
    path = tmp_path / f"blob{plan.index}.safetensors"
    path.write_bytes(blob)
    return path


def as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("writer", [write_llm_like, write_mlx, write_one_giant])
@pytest.mark.parametrize("shard_count", [1, 3, 4, 7, 1000])
def test_every_blob_is_a_safetensors_file_with_the_source_tensors(tmp_path, writer, shard_count):
    path = tmp_path / "source.safetensors"
    writer(path)
    header = read_header(path)
    source = path.read_bytes()
    plans = plan_shards(header, shard_count)
    assert_is_partition(header, plans)
    with safe_open(str(path), framework="pt") as original:
        for plan in plans:
            assert len(plan.prefix) % 8 == 0  # blob data starts 8-aligned
            assert read_header(write_blob(tmp_path, source, header, plan)).metadata is None
            with safe_open(str(tmp_path / f"blob{plan.index}.safetensors"), framework="pt") as blob:
                assert sorted(blob.keys()) == sorted(plan.tensors)
                for name in plan.tensors:
                    mine, theirs = blob.get_tensor(name), original.get_tensor(name)
                    assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
                    assert as_bytes(mine) == as_bytes(theirs)


def test_unchanged_shards_give_identical_blobs_across_versions(tmp_path):
    from safetensors.torch import save_file

    first, second = tmp_path / "v1.safetensors", tmp_path / "v2.safetensors"
    write_llm_like(first)
    tensors = llm_like_tensors()
    tensors["lm_head.weight_int8"] = -tensors["lm_head.weight_int8"]  # training moved one tensor
    save_file(tensors, str(second), metadata={"step": "200"})  # and the metadata changed too
    blobs = []
    for path in (first, second):
        header, source = read_header(path), path.read_bytes()
        plans = plan_shards(header, 4)
        blobs.append(
            [
                (
                    plan.prefix,
                    hashlib.sha256(
                        write_blob(tmp_path, source, header, plan).read_bytes()
                    ).hexdigest(),
                )
                for plan in plans
            ]
        )
    old, new = blobs
    assert read_header(first).header_bytes != read_header(second).header_bytes
    changed = [index for index in range(4) if old[index] != new[index]]
    assert len(changed) == 1  # only the shard holding lm_head differs
    assert all(old[index][0] == new[index][0] for index in range(4))  # same tensors, same prefix
