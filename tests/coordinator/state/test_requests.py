"""Requests (intents) on a real redis-server."""

from __future__ import annotations


def test_requests_take_one_counter_and_close_once(md):
    first = md.requests.open_request("r1", "store", "host-a", {"path": "/x"})
    second = md.requests.open_request("r2", "gather", "host-a", {"vkey": "v"})
    assert second == first + 1
    assert [rid for rid, _ in md.requests.open_requests()] == ["r1", "r2"]
    assert md.requests.start_request("r1", "boot-1") == "queued"
    assert md.requests.request("r1")["state"] == "running"
    md.requests.finish_request("r1", "done", vkey="v1")
    assert md.requests.start_request("r1", "boot-2") == "done"  # a re-drive does not run it again
    assert [rid for rid, _ in md.requests.open_requests()] == ["r2"]
    assert md.r.ttl("smoltorrent:request:r1") > 0
