"""The store task's per-entry targets: held through the task, so shared, not copied."""

from __future__ import annotations

from tasks.store import shared_targets


def test_entries_with_the_same_node_order_share_one_tuple():
    chunks = [["b", "a"], ("a", "b"), ["b", "a"], ("c",), ["a", "b"], ("c",)] * 1000
    targets = shared_targets(iter(chunks))
    assert targets == [tuple(t) for t in chunks]
    assert len({id(t) for t in targets}) == 3  # ("b", "a"), ("a", "b"), ("c",)
