"""Dead letters on a real redis-server."""

from __future__ import annotations

import json
import time

from coordinator.state import redis_keys as K
from smoltorrent import defaults


def test_dead_letters_are_recorded_listed_and_removed(md):
    md.dead_letters.add_dead_letter(
        "transfer-x-0-1", {"task": "smoltorrent.transfer", "error": "boom"}
    )
    md.dead_letters.add_dead_letter(
        "transfer-x-1-1", {"task": "smoltorrent.transfer", "error": "bang"}
    )
    assert [r["task_id"] for r in md.dead_letters.dead_letters()] == [
        "transfer-x-0-1",
        "transfer-x-1-1",
    ]
    assert md.dead_letters.dead_letter_depth() == 2
    md.dead_letters.remove_dead_letter("transfer-x-0-1")
    assert md.dead_letters.dead_letter("transfer-x-1-1")["error"] == "bang"
    assert md.r.xlen("smoltorrent:dlq:stream") == 2  # the index keeps the history


def test_dead_letters_older_than_their_age_limit_are_pruned(md):
    """Dead letters were never pruned: Redis grew by one record per failure for ever."""
    vkey = "a" * 32
    md.dead_letters.add_dead_letter(f"transfer-{vkey}-0-1", {"kwargs": {"vkey": vkey}})
    md.dead_letters.add_dead_letter("commit-" + "b" * 32, {"error": "recent"})
    now = time.time()
    later = now + defaults.DEAD_LETTER_MAX_AGE_S + 60
    # Only the first is old enough: the second is dated at the limit exactly.
    raw = json.loads(md.r.hget(K.DLQ, "commit-" + "b" * 32))
    md.r.hset(K.DLQ, "commit-" + "b" * 32, json.dumps({**raw, "at": later - 30}))
    assert md.dead_letters.prune(older_than_s=defaults.DEAD_LETTER_MAX_AGE_S, now=later) == 1
    assert [r["task_id"] for r in md.dead_letters.dead_letters()] == ["commit-" + "b" * 32]
    assert not md.r.exists(K.DLQ_OF.format(vkey=vkey))  # its version index went with it
    assert md.dead_letters.prune(older_than_s=defaults.DEAD_LETTER_MAX_AGE_S, now=later) == 0
