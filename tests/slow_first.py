"""The order the suite runs in under pytest-xdist: its slowest tests first, spread over
the workers.

xdist's worksteal hands each worker one contiguous block of the collection at the start
and lets an idle worker take the back half of the longest queue. In collection order the
slow tests bunch up (tests/smoltorrent's torch runs, tests/tasks' big shard), so one
worker's block held most of them and ran them one after another at the end of the run,
while the CPU-bound box had workers idle. Here each block starts with its share of them,
dealt longest first to the block with the fewest seconds so far (LPT), and the fast tests
fill the rest in collection order, so the tail is made of short tests another worker can
steal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

LISTED = Path(__file__).with_name("slow_tests.txt")


def slow_seconds(path: Path = LISTED) -> dict[str, float]:
    """nodeid -> seconds, from lines of "SECONDS NODEID" (# starts a comment)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, nodeid = line.split(None, 1)
            out[nodeid.strip()] = float(seconds)
    return out


def block_sizes(count: int, workers: int) -> list[int]:
    """The blocks worksteal's first schedule cuts: each idle worker in turn gets the
    pending tests' count over the workers still to serve."""
    sizes = []
    for i in range(workers):
        sizes.append(count // (workers - i))
        count -= sizes[-1]
    return sizes


def slow_first(
    items: list[pytest.Item], workers: int, seconds: dict[str, float]
) -> list[pytest.Item]:
    """`items` reordered so each of `workers` blocks starts with its share of the slow
    ones. The same items in a deterministic order: every xdist worker must collect alike."""
    if workers < 2:
        return items
    slow = sorted((i for i in items if i.nodeid in seconds), key=lambda i: -seconds[i.nodeid])
    rest = [i for i in items if i.nodeid not in seconds]
    sizes = block_sizes(len(items), workers)
    heads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for item in slow:
        room = [w for w in range(workers) if len(heads[w]) < sizes[w]]
        w = min(room, key=lambda w: (load[w], w))
        heads[w].append(item)
        load[w] += seconds[item.nodeid]
    out, taken = [], 0
    for w in range(workers):
        fill = sizes[w] - len(heads[w])
        out += heads[w] + rest[taken : taken + fill]
        taken += fill
    return out
