"""Wake-ups on a real redis-server: one pushed before its waiter blocks is still there,
each is taken once, none lingers past its expiry, and closing a request pushes its own."""

from __future__ import annotations

from coordinator.state import redis_keys as K
from coordinator.state import wakeups
from smoltorrent import defaults


def test_a_wake_up_pushed_before_the_wait_is_taken_once(md):
    key = K.VERSION_WAKE.format(vkey="v1")
    wakeups.wake(md.r, key)  # the commit ended between the waiter's read and its block
    assert 0 < md.r.ttl(key) <= defaults.WAKE_TTL_S  # a hint nobody took expires
    assert wakeups.wait(md.r, key, 5.0)
    assert not md.r.exists(key)
    # Nothing pushed: the wait lasts its time (a few ms here) and says so.
    assert not wakeups.wait(md.r, key, 0.01)


def test_closing_a_request_wakes_its_waiter(md):
    md.requests.open_request("r1", "store", "host-a", {"path": "/x"})
    key = K.REQUEST_WAKE.format(rid="r1")
    assert not md.r.exists(key)  # opening and running it wake nobody
    md.requests.finish_request("r1", "done", vkey="v1")
    assert wakeups.wait(md.r, key, 5.0)
