"""Requests (intents) on a real redis-server."""

from __future__ import annotations

import time


def test_requests_take_one_counter_and_close_once(md):
    first = md.requests.open_request("r1", "store", "host-a", {"path": "/x"})
    second = md.requests.open_request("r2", "gather", "host-a", {"vkey": "v"})
    assert second == first + 1
    assert [rid for rid, _ in md.requests.open_requests()] == ["r1", "r2"]
    assert md.requests.start_request("r1", "boot-1").found == "queued"
    assert md.requests.request("r1")["state"] == "running"
    md.requests.finish_request("r1", "done", vkey="v1")
    assert md.requests.start_request("r1", "boot-2").done  # a re-drive does not run it again
    assert [rid for rid, _ in md.requests.open_requests()] == ["r2"]
    assert md.r.ttl("smoltorrent:request:r1") > 0


def test_a_running_request_stays_with_the_run_holding_its_lease_until_it_lapses(md):
    md.requests.open_request("r1", "store", "host-a", {"path": "/x"})
    assert md.requests.start_request("r1", "boot-1", "boot-1:10", lease_s=1).found == "queued"
    # A second delivery while the first run holds the lease is told who has it.
    second = md.requests.start_request("r1", "boot-1", "boot-1:11", lease_s=1)
    assert second.holder == "boot-1:10" and 0 < second.lease_left_s <= 1
    assert md.requests.request("r1")["owner"] == "boot-1:10"
    # The holder renewing keeps it; a run it does not hold cannot renew it.
    assert md.requests.renew_lease("r1", "boot-1:10", 1)
    assert not md.requests.renew_lease("r1", "boot-1:11", 1)
    # A run known to be dead is taken over at once.
    taken = md.requests.start_request("r1", "boot-2", "boot-2:12", dead_owner="boot-1:10")
    assert taken.found == "running" and not taken.holder
    # Dropped (its run ended without finishing it): the next delivery takes it at once.
    assert md.requests.renew_lease("r1", "boot-2:12", 0)
    assert not md.requests.start_request("r1", "boot-2", "boot-2:13", lease_s=0.5).holder
    # Killed (never renewed nor dropped): its lease lapses on the Redis clock.
    assert md.requests.start_request("r1", "boot-2", "boot-2:14").holder == "boot-2:13"
    time.sleep(0.6)
    assert not md.requests.start_request("r1", "boot-2", "boot-2:14").holder
    assert md.requests.request("r1")["deferred"] == "2"


def test_a_request_opened_again_is_recorded_once(md):
    # A client whose reply Redis lost (a restart) opens its request again: the second
    # open must neither take a new number (it orders the name's versions) nor reset a
    # request a worker already started to queued.
    first = md.requests.open_request("r1", "store", "host-a", {"path": "/x"})
    md.requests.start_request("r1", "boot-1")
    assert md.requests.open_request("r1", "store", "host-a", {"path": "/x"}) == first
    assert md.requests.request("r1")["state"] == "running"
    assert md.requests.next_seq() == first + 1
