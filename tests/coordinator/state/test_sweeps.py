"""Which sweep locks a starting worker frees (coordinator/state/sweeps.py): only those an
earlier boot of its own host held, on a real redis-server."""

from __future__ import annotations

from coordinator.state import redis_keys as K
from coordinator.state.sweeps import lock_holder


def test_only_the_locks_of_this_hosts_dead_boots_are_freed(md):
    held = {
        "reconcile": lock_holder("h1", "old-boot", "r1"),  # this host, its last boot: freed
        "health": lock_holder("h1", "new-boot", "r2"),  # this host, this boot: alive
        "repair": lock_holder("h2", "old-boot", "r3"),  # another host's: its own to free
        "scrub": "a-token-of-another-kind",  # not a holder this code wrote
    }
    for name, holder in held.items():
        md.r.set(K.SWEEP_LOCK.format(name=name), holder, ex=600)
    names = [*held, "crosscheck"]  # one sweep holds no lock at all
    assert md.sweeps.free_locks_of_dead_boots(names, "h1", "new-boot") == ["reconcile"]
    left = {n: md.r.get(K.SWEEP_LOCK.format(name=n)) for n in names}
    assert left == {**held, "reconcile": None, "crosscheck": None}
