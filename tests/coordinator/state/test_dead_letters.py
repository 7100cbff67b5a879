"""Dead letters on a real redis-server."""

from __future__ import annotations


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
