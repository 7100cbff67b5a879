"""What `smoltorrent beat` writes when the Redis under it restarts: a line that says so,
not a traceback per tick (about 1,000 lines for a restart of a few seconds)."""

from __future__ import annotations

import time
from pathlib import Path

from coordinator.local.cluster import LocalCluster
from tests.tasks.conftest import wait_until

FAST = {  # a sweep sent every second, so beat is sending while Redis is away
    "SMOLTORRENT_CROSSCHECK_INTERVAL_S": "1",
    "SMOLTORRENT_RECONCILE_INTERVAL_S": "1",
}
DOWN_S = 25.0  # seconds Redis stays away: past the ~20 s the result subscription retried


def test_beat_says_in_a_line_that_redis_restarted(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path / "cluster", nodes=0, extra_env=dict(FAST))
    cluster.root.mkdir(parents=True)
    cluster.start_redis()
    log = cluster.root / "beat.log"
    try:
        cluster.start_beat()
        sent = "Sending due task"
        wait_until(lambda: log.exists() and sent in log.read_text(), 60, what="beat's first send")
        # Counted before the kill: beat, sending every second, may say the outage's line
        # before this thread reads the log again (a loaded CI run saw it so).
        before = len(log.read_text().splitlines())
        cluster.kill_redis()
        time.sleep(DOWN_S)
        cluster.start_redis()
        lines = lambda: log.read_text().splitlines()[before:]  # noqa: E731
        wait_until(lambda: sum(sent in x for x in lines()) >= 4, 60, what="beat sending again")
        time.sleep(2)  # what beat writes once it is back
        after = lines()
        noise = [x for x in after if sent not in x]
        assert len(noise) <= 4, "\n".join(after)
        assert not any("Traceback" in x for x in after), "\n".join(after)
        assert sum("lost Redis" in x for x in noise) == 1, after
        assert sum("Redis is back" in x for x in after) == 1, after
    finally:
        cluster.stop()
