"""Cut a checkpoint into shards: contiguous runs of tensors, balanced by size.

A shard is a run of whole tensors in data order, so its bytes are one
contiguous range of the source and a transfer is one sendfile. The partition
minimises the largest shard (the slowest transfer bounds a store and a
gather); among the partitions that reach that optimum, each cut is placed as
close as it can be to an equal share of what is left, so the smaller shards
come out even too.

Each shard travels as a blob: a small safetensors header of its own, then
its range of the source. The blob header holds the shard's tensors only, with
offsets rebased to zero and no `__metadata__` (not even the shard index):
it depends on nothing but the tensors it describes, so a shard that did not
change between two versions becomes the same blob, with the same SHA-256,
even if it moved to another index, and is stored once.
"""

from __future__ import annotations

import bisect
import itertools
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.plan.safetensors_header import LENGTH_PREFIX_BYTES, CheckpointHeader, TensorInfo

_HEADER_ALIGNMENT = 8  # bytes; blob data then starts 8-aligned, as safetensors writers do


@dataclass(frozen=True)
class ShardPlan:
    index: int
    data_start: int  # relative to the source's data section
    data_end: int
    tensors: tuple[str, ...]  # in data order
    prefix: bytes  # the blob's own header: 8-byte LE length + padded JSON, offsets from 0

    @property
    def data_size(self) -> int:
        return self.data_end - self.data_start

    @property
    def blob_size(self) -> int:
        return len(self.prefix) + self.data_size


def plan_shards(header: CheckpointHeader, n_shards: int) -> list[ShardPlan]:
    """Partition the tensors into min(n_shards, tensor count) shards, at least one."""
    tensors = header.tensors
    if not tensors:
        return []
    shard_count = max(1, min(n_shards, len(tensors)))
    ends = _cut_points([tensor.size for tensor in tensors], shard_count)
    plans = []
    for index, (first, stop) in enumerate(itertools.pairwise([0, *ends])):
        members = tensors[first:stop]
        plans.append(
            ShardPlan(
                index=index,
                data_start=members[0].start,
                data_end=members[-1].end,
                tensors=tuple(tensor.name for tensor in members),
                prefix=blob_prefix(members),
            )
        )
    return plans


def blob_prefix(tensors: Sequence[TensorInfo]) -> bytes:
    """The standalone safetensors header for a contiguous run of tensors."""
    base = tensors[0].start
    entries = {
        tensor.name: {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [tensor.start - base, tensor.end - base],
        }
        for tensor in tensors
    }
    # Canonical JSON: the same tensors always give the same bytes.
    header = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-(LENGTH_PREFIX_BYTES + len(header)) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(header)) + header


def _cut_points(sizes: Sequence[int], shard_count: int) -> list[int]:
    """End index (exclusive) of each of exactly `shard_count` non-empty contiguous groups."""
    prefix_sums = [0, *itertools.accumulate(sizes)]
    bound = _smallest_bound(prefix_sums, max(sizes), shard_count)
    total = len(sizes)
    # furthest[i]: where a group starting at i must end at the latest under the bound.
    furthest = [bisect.bisect_right(prefix_sums, prefix_sums[i] + bound) - 1 for i in range(total)]
    # groups_needed[i]: fewest groups the tail from i needs under the bound
    # (greedy longest groups are optimal); it never grows as i moves right.
    groups_needed = [0] * (total + 1)
    for i in range(total - 1, -1, -1):
        groups_needed[i] = 1 + groups_needed[furthest[i]]

    ends: list[int] = []
    start = 0
    for remaining in range(shard_count, 1, -1):
        # Ends that keep this group under the bound and leave a tail that
        # `remaining - 1` non-empty groups can still cover under it.
        latest = min(furthest[start], total - (remaining - 1))
        earliest = start + 1
        while groups_needed[earliest] > remaining - 1:
            earliest += 1
        ends.append(_closest_to_fair_share(prefix_sums, start, earliest, latest, remaining))
        start = ends[-1]
    ends.append(total)
    return ends


def _closest_to_fair_share(
    prefix_sums: Sequence[int], start: int, earliest: int, latest: int, remaining: int
) -> int:
    """The end in [earliest, latest] whose group is nearest 1/remaining of the tail.

    Ties go to the smaller group.
    """
    tail = prefix_sums[-1] - prefix_sums[start]

    def distance(end: int) -> int:
        # Scaled by `remaining` to stay in exact integers.
        return abs(remaining * (prefix_sums[end] - prefix_sums[start]) - tail)

    # Round the share up: the last end below it and the first at or above it
    # are then the only candidates for the nearest.
    target = prefix_sums[start] - (-tail // remaining)
    above = bisect.bisect_left(prefix_sums, target, earliest, latest + 1)
    candidates = {min(max(end, earliest), latest) for end in (above - 1, above)}
    return min(sorted(candidates), key=distance)


def _smallest_bound(prefix_sums: Sequence[int], largest: int, shard_count: int) -> int:
    """The least possible size of the largest group: binary search on the bound."""
    low, high = largest, prefix_sums[-1]
    while low < high:
        middle = (low + high) // 2
        if _fits(prefix_sums, middle, shard_count):
            high = middle
        else:
            low = middle + 1
    return low


def _fits(prefix_sums: Sequence[int], bound: int, shard_count: int) -> bool:
    """Whether greedy longest groups under `bound` cover everything in `shard_count` groups."""
    start, groups, total = 0, 0, len(prefix_sums) - 1
    while start < total:
        if groups == shard_count:
            return False
        # Jump to the furthest end under the bound: O(groups * log n), not O(n).
        start = bisect.bisect_right(prefix_sums, prefix_sums[start] + bound) - 1
        groups += 1
    return True
