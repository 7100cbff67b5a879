"""`ordered_map`: a thread pool's map over many items that holds only a few calls at a time.

`Executor.map` submits every item before it returns: a Future (a Condition, its lock and
waiters) and a work item per item, all alive together. Over a checkpoint's chunks that was
about 1.7 KB of Python objects per chunk in the pool child that stores (traced at the
store task's peak: 8 MB for 16 GB's 4,629 chunks), allocated and freed once per store:
most of the store task's transient peak that grew with the chunk count
(bench/RESULTS.md, "2026-11-29: worker memory 1 to 16 GB"). Here at most `ahead` calls are
submitted and not yet taken: the threads always have the next one queued, and the memory
is the same for 300 chunks or 5,000.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import TypeVar

from smoltorrent import defaults

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(
    pool: Executor,
    fn: Callable[[T], R],
    items: Iterable[T],
    ahead: int = defaults.MAP_AHEAD_CALLS,
) -> Iterator[R]:
    """fn(item) for every item, run on `pool`, in order, as pool.map gives them; at most
    `ahead` calls submitted and not yet taken. The first call that raises raises here;
    the calls not yet started are cancelled, as pool.map does."""
    ahead = max(1, ahead)
    todo = iter(items)
    pending: deque[Future[R]] = deque(
        pool.submit(fn, item) for item in itertools.islice(todo, ahead)
    )
    try:
        while pending:
            first = pending.popleft()
            for item in itertools.islice(todo, 1):
                pending.append(pool.submit(fn, item))
            yield first.result()
    finally:
        for future in pending:
            future.cancel()
