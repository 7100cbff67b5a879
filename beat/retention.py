"""The retention sweep: keep the last K committed versions of every name, the K newest
entries under each prefix that has a rule (coordinator/state/retention.py), never a pinned
version, and dead letters for DEAD_LETTER_MAX_AGE_S.

Which versions are past K is decided here from the versions zset (ordered by the
sequence number of their latest request, never by wall clocks); the decision is
made again, atomically with the state change, by the retire script, which also
refuses the current version and any version a gather holds a reader mark on. A
retired version is removing: the usual remove task deletes the blobs no other
version uses (the reference sets) and its manifests on the nodes, and the
reconcile sweep resumes it if that remove dies.
"""

from __future__ import annotations

from collections import Counter

from celery.utils.log import get_task_logger

from beat.sweeps import sweep
from coordinator import config
from coordinator.state.metadata import Metadata
from coordinator.state.retention import plan, rules
from coordinator.state.versions import ABORTED, COMMITTED
from smoltorrent import defaults
from tasks.context import metadata
from tasks.enqueue import send_remove

log = get_task_logger(__name__)


def candidates(md: Metadata, name: str, keep: int, states: dict[str, str]) -> list[str]:
    """Versions of `name` retention would remove, by `states` (vkey -> state): committed
    ones past the `keep` newest committed, aborted ones older than a committed one. Pending
    and removing versions are never candidates (md.removals.retire checks again, atomically)."""
    out, newer = [], 0
    for vkey in reversed(md.versions.versions(name)):  # newest request first
        state = states.get(vkey)
        if state == COMMITTED:
            if newer >= keep:
                out.append(vkey)
            newer += 1
        elif state == ABORTED and newer:
            out.append(vkey)
    return out


def run_pass(keep: int | None = None) -> dict[str, int]:
    """Retire every candidate the script agrees to, and send its remove; a count of
    outcomes ("retired", "reading", "pinned", ...)."""
    md = metadata()
    keep = config.keep_last() if keep is None else keep
    outcomes: Counter[str] = Counter()

    def retire(name: str, vkey: str, k: int, before: int | None = None) -> None:
        outcome = md.removals.retire(vkey, k, before)
        outcomes[outcome] += 1
        if outcome == "retired":
            send_remove(vkey)
        elif outcome == "reading":
            log.info("retention: %s %s is being gathered; removed later", name, vkey[:12])

    states = md.listing.version_states()  # a cursor over one hash, not a request per version
    for name in md.versions.names():
        for vkey in candidates(md, name, keep, states):
            retire(name, vkey, keep)
    for prefix, k in rules(md).items():
        names, before = plan(md, prefix, k)
        for name in names:
            for vkey in md.versions.versions(name):  # oldest request first
                retire(name, vkey, k, before)
    pruned = md.dead_letters.prune(defaults.DEAD_LETTER_MAX_AGE_S)
    if pruned:
        outcomes["dead letters pruned"] = pruned
    if outcomes:
        log.info("retention (keep %d, and per prefix): %s", keep, dict(outcomes))
    return dict(outcomes)


@sweep("retention")
def retention() -> dict[str, int]:
    """One pass over every name."""
    return run_pass()
