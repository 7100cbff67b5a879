"""Node and worker records on a real redis-server."""

from __future__ import annotations


def test_live_workers_are_found_without_scanning_the_keyspace(md):
    md.nodes.worker_alive("host-a", "boot-1")
    md.nodes.worker_alive("host-b", "boot-2")
    md.r.delete("smoltorrent:worker:host-b:alive")  # its TTL ran out
    md.r.config_resetstat()
    assert md.nodes.worker_boots() == {"host-a": "boot-1"}
    assert "cmdstat_scan" not in md.r.info("commandstats")
    md.nodes.worker_alive("host-b", "boot-3")  # back
    assert md.nodes.worker_boots() == {"host-a": "boot-1", "host-b": "boot-3"}
