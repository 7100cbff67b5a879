"""tests/slow_first.py: the slowest tests head the blocks xdist's worksteal hands out."""

from __future__ import annotations

from types import SimpleNamespace

from tests.slow_first import LISTED, block_sizes, slow_first, slow_seconds


def test_each_block_starts_with_its_share_of_the_slow_tests_longest_first():
    items = [SimpleNamespace(nodeid=f"t{i}") for i in range(103)]
    seconds = {"t100": 90.0, "t101": 60.0, "t102": 50.0, "t7": 40.0, "t50": 10.0}
    out = slow_first(items, 4, seconds)
    assert sorted(out, key=lambda i: int(i.nodeid[1:])) == items  # the same items
    starts, blocks = 0, []
    for size in block_sizes(len(items), 4):
        blocks.append(out[starts : starts + size])
        starts += size
    assert [b[0].nodeid for b in blocks] == ["t100", "t101", "t102", "t7"]
    assert blocks[3][1].nodeid == "t50"  # the least-loaded block takes the next
    fast = [i.nodeid for i in out if i.nodeid not in seconds]
    assert fast == [i.nodeid for i in items if i.nodeid not in seconds]  # in collection order
    assert slow_first(items, 1, seconds) == items


def test_worksteals_first_blocks_and_the_listed_tests_are_parsed():
    assert block_sizes(1280, 4) == [320, 320, 320, 320]
    assert block_sizes(10, 4) == [2, 2, 3, 3]
    listed = slow_seconds(LISTED)
    assert listed and all(n.startswith("tests/") and "::" in n for n in listed)
