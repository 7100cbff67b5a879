"""The limits tasks are sent with, against the broker's visibility timeout: a task still
running when its message's visibility timeout passes is delivered again and runs twice."""

from __future__ import annotations

from smoltorrent import defaults
from tasks.enqueue import chain_time_limit, transfer_time_limit

# Every backoff step of a delivery task's retries (the countdowns the worker holds).
BACKOFF_S = sum(
    min(defaults.RETRY_BACKOFF_BASE_S * 2**n, defaults.RETRY_BACKOFF_MAX_S)
    for n in range(defaults.TRANSFER_RETRIES + 1)
)


def test_no_transfer_or_chain_outlives_the_visibility_timeout():
    """A chain's limit was twice a transfer's, up to 24 h over a visibility timeout of
    about 14.3 h: a shard over about 54 GB could run twice at once."""
    for size in (0, 10**9, 54 * 10**9, 100 * 10**9, 10**13):
        transfer = transfer_time_limit(size)
        chain = chain_time_limit(transfer)
        assert transfer + BACKOFF_S < defaults.VISIBILITY_TIMEOUT_S, size
        assert chain + BACKOFF_S < defaults.VISIBILITY_TIMEOUT_S, size
        assert chain >= transfer  # a chain still gets at least one transfer's time
