"""ordered_map: pool.map's results, with only a few calls submitted at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from coordinator.dataplane.ordered_map import ordered_map


class CountingPool(ThreadPoolExecutor):
    """Counts the Futures submitted and not yet done-and-taken."""

    def __init__(self, threads: int) -> None:
        super().__init__(max_workers=threads)
        self.lock = threading.Lock()
        self.submitted = 0
        self.most_ahead = 0
        self.taken = 0

    def submit(self, fn, *args, **kwargs):
        with self.lock:
            self.submitted += 1
            self.most_ahead = max(self.most_ahead, self.submitted - self.taken)
        return super().submit(fn, *args, **kwargs)


def test_the_results_come_in_order_as_pool_map_gives_them():
    with ThreadPoolExecutor(max_workers=3) as pool:
        items = list(range(500))
        assert list(ordered_map(pool, lambda x: x * x, items)) == list(
            pool.map(lambda x: x * x, items)
        )


def test_no_more_than_ahead_calls_are_submitted_at_once_however_many_items():
    with CountingPool(2) as pool:
        out = []
        for result in ordered_map(pool, lambda x: x + 1, range(1000), ahead=4):
            out.append(result)
            with pool.lock:
                pool.taken += 1
        assert out == list(range(1, 1001))
        assert pool.submitted == 1000
        # The one being taken plus `ahead` queued behind it.
        assert pool.most_ahead <= 4 + 1


def test_a_call_that_raises_raises_and_the_rest_is_not_submitted():
    calls = []

    def fn(x):
        calls.append(x)
        if x == 10:
            raise ValueError("chunk 10")
        return x

    with ThreadPoolExecutor(max_workers=2) as pool, pytest.raises(ValueError, match="chunk 10"):
        list(ordered_map(pool, fn, range(10_000), ahead=4))
    assert len(calls) < 100  # not every item was queued up front


def test_no_items_no_calls():
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(ordered_map(pool, lambda x: x, [])) == []
