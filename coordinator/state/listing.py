"""The listing: what `ls` and `status` read instead of every version's hash and manifest.

Each listed version has a row (its fields that never change, versions.listing_row) and a
state in two hashes, and a place in the all-versions zset, kept by the same scripts that
change the version; a listing reads them a slice at a time in one script
(lua/listing/slice.lua), with each blob's placement from its listed copy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import redis

from coordinator.plan.manifest import Manifest
from coordinator.state import redis_keys as K
from coordinator.state.scripts import load
from coordinator.state.versions import PENDING, listing_row
from smoltorrent import defaults
from smoltorrent.errors import MetadataError


class Listing:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._slice = load(r, "listing/slice")
        self._fill_summary = load(r, "listing/fill_summary")

    def version_states(self) -> dict[str, str]:
        """vkey -> state of every listed version, read with a cursor (HSCAN): one HGETALL
        of 10,000 versions held Redis ~7-9 ms, and it grows with them."""
        self._fill_summaries()
        return dict(self.r.hscan_iter(K.VERSION_STATES, count=defaults.LISTING_SCAN_COUNT))

    def listed_states(self) -> tuple[list[str], dict[str, str]]:
        """Every listed vkey in request order, and vkey -> state, both read with cursors
        (ZSCAN, HSCAN: no one request grows with the versions; no version hash read). A
        version listed throughout is read once at least, in its place as last seen."""
        self._fill_summaries()
        places = dict(self.r.zscan_iter(K.ALL_VERSIONS, count=defaults.LISTING_SCAN_COUNT))
        vkeys = sorted(places, key=lambda v: (places[v], v))  # the zset's own order
        return vkeys, self.version_states()

    def vkeys_in(self, states: Iterable[str]) -> list[str]:
        """The vkeys of every listed version in one of `states`, in request order."""
        vkeys, found = self.listed_states()
        return [v for v in vkeys if found.get(v) in states]

    def pending_versions(self) -> list[str]:
        return self.vkeys_in((PENDING,))

    def versions_in(self, *states: str) -> list[tuple[str, dict[str, str]]]:
        """(vkey, version hash) of every listed version in one of `states`, in request order:
        the states of all come from one hash, and only the matching versions are read, one
        round trip per LISTING_BATCH_VERSIONS (verify reads every committed one)."""
        vkeys = self.vkeys_in(states)
        hashes: list[dict[str, str]] = []
        for start in range(0, len(vkeys), defaults.LISTING_BATCH_VERSIONS):
            with self.r.pipeline(transaction=False) as p:
                for vkey in vkeys[start : start + defaults.LISTING_BATCH_VERSIONS]:
                    p.hgetall(K.VERSION.format(vkey=vkey))
                hashes += p.execute()
        return [
            (vkey, v) for vkey, v in zip(vkeys, hashes, strict=True) if v.get("state") in states
        ]

    def version_summaries(
        self,
        name: str | None,
        among: Iterable[str],
        live: Iterable[str] | None = None,
        digests: bool = False,
        notable: Iterable[str] | None = None,
    ) -> list[dict]:
        """Every listed version (of `name` only, if given) as `ls` shows it, ordered by name,
        then request: the fields of its listing row (its shards' digests only if `digests`),
        plus vkey, state, current, transfers_settled, reason, copies (per shard, how many of
        the nodes `among` hold it), min_copies, under_replicated and live (the same as copies
        among the nodes `live`, if given; else None). With `notable` (blob digests), only
        the versions `status` reports: pending, committed with a shard under its replicas
        (among `live` if given), or using one of those blobs. One script call per slice of
        LISTING_SLICE_VERSIONS versions or LISTING_SLICE_DIGESTS blobs, each alone (no one
        call holds Redis long): no version hash or manifest is read. A slice that meets a
        version not committed or a placement not listed, whose keys it was not passed, names
        them; that slice runs again with them (a second run at most, unless versions change
        in between), and they are named for the next listing's first run (LISTING_HINT)."""
        zset = K.ALL_VERSIONS if name is None else K.VERSIONS.format(name=name)
        with self.r.pipeline(transaction=False) as p:
            p.exists(K.SUMMARIES_FILLED)
            p.get(K.LISTING_HINT)
            filled, hint = p.execute()
        if not filled:
            self._fill_summaries()
        among = list(among)
        live = None if live is None else list(live)
        options = ("d" if digests else "") + ("" if notable is None else "n")
        wanted = list(notable or ())
        nodes = [len(among), *among, *([-1] if live is None else [len(live), *live])]
        nodes += [len(wanted), *wanted]
        # What the last listing had to pass in a second run (the pending versions of stores
        # in flight, new placements), passed in the first: most slices run once.
        hinted = json.loads(hint) if hint else {"v": [], "d": []}
        passed: list[tuple[list[str], list[str]]] = []
        rows: dict[str, dict] = {}
        cursor, more, slices = ("-inf", ""), True, 0
        while more:
            slices += 1
            # Each slice alone: no one call holds Redis for long (lua/listing/slice.lua).
            # The cursor is the last version read, not a rank, so a version removed or
            # added meanwhile shifts nothing: every version listed throughout is read.
            vkeys, blobs = list(hinted["v"]), list(hinted["d"])
            for _ in range(defaults.SCRIPT_KEY_RETRIES):
                keys = [zset, K.VERSION_ROWS, K.VERSION_STATES, K.CURRENT, K.PLACEMENTS_LISTED]
                for v in vkeys:
                    keys += [K.VERSION.format(vkey=v), K.SETTLED.format(vkey=v)]
                keys += [K.PLACEMENT.format(digest=d) for d in blobs]
                args = [*cursor, defaults.LISTING_SLICE_VERSIONS, defaults.LISTING_SLICE_DIGESTS]
                reply = self._slice(keys=keys, args=[*args, options, *nodes, len(vkeys), *vkeys,
                                                     *blobs])  # fmt: skip
                if not isinstance(reply, str):
                    break
                # What the slice needs passed: {"v": ..., "d": ...}; the same slice again.
                need = json.loads(reply)
                vkeys += [v for v in need["v"].split() if v not in vkeys]
                blobs += [d for d in need["d"].split() if d not in blobs]
                passed.append((vkeys, blobs))
            else:
                raise MetadataError(
                    f"the versions listed changed under the listing {defaults.SCRIPT_KEY_RETRIES}"
                    " times in a row; try again."
                )
            text, *cursor, again = reply
            more = again == "1"
            for row in json.loads(text):
                # A version made latest meanwhile (a rollback) moved past the cursor and
                # is read again there: its later place is the one kept.
                rows.pop(row["vkey"], None)
                rows[row["vkey"]] = row
        if passed:
            self._keep_hint([(list(hinted["v"]), list(hinted["d"])), *passed])
        out = list(rows.values())
        if slices > 1:
            self._current_now(out)
        out.sort(key=lambda r: r["name"])  # stable: request order within a name
        return out

    def _current_now(self, rows: list[dict]) -> None:
        """Each row's "current" as CURRENT says after the last slice: a name's versions can
        span slices, and a commit between two would have shown two current versions."""
        names = sorted({r["name"] for r in rows})
        current = {}
        for start in range(0, len(names), defaults.LISTING_SLICE_VERSIONS):
            batch = names[start : start + defaults.LISTING_SLICE_VERSIONS]
            current.update(zip(batch, self.r.hmget(K.CURRENT, batch), strict=True))
        for row in rows:
            row["current"] = current[row["name"]] == row["vkey"]

    def _keep_hint(self, keyed: list[tuple[list[str], list[str]]]) -> None:
        """Name for the next listing what this one passed (the hint it was given and what
        it had to pass besides); best effort, bounded by LISTING_HINT_MAX_KEYS. A hint not
        renewed by a second run expires, so keys no longer needed leave it."""
        vkeys = {v for vs, _ in keyed for v in vs}
        blobs = {d for _, ds in keyed for d in ds}
        cap = defaults.LISTING_HINT_MAX_KEYS
        if len(vkeys) + len(blobs) <= cap:
            hint = {"v": sorted(vkeys), "d": sorted(blobs)}
            self.r.set(K.LISTING_HINT, json.dumps(hint), ex=defaults.LISTING_HINT_TTL_S)

    def _fill_summaries(self) -> None:
        """Listing rows and states for the versions recorded before they existed: once per
        Redis (a marker key says it is done), each version in one atomic step."""
        if self.r.exists(K.SUMMARIES_FILLED):
            return
        listed = [
            (name, vkey)
            for name in sorted(self.r.smembers(K.NAMES))
            for vkey in self.r.zrange(K.VERSIONS.format(name=name), 0, -1)
        ]
        for i in range(0, len(listed), defaults.LISTING_BATCH_VERSIONS):
            batch = listed[i : i + defaults.LISTING_BATCH_VERSIONS]
            with self.r.pipeline(transaction=False) as p:
                for _, vkey in batch:
                    p.hget(K.VERSION.format(vkey=vkey), "transfers")
                    p.get(K.MANIFEST.format(vkey=vkey))
                found = p.execute()
            with self.r.pipeline(transaction=False) as p:
                for j, (name, vkey) in enumerate(batch):
                    transfers, raw = found[2 * j], found[2 * j + 1]
                    if raw is None:
                        continue  # removed meanwhile
                    row = listing_row(Manifest.from_json(raw), int(transfers or 0))
                    keys = [
                        K.VERSION.format(vkey=vkey),
                        K.VERSIONS.format(name=name),
                        K.VERSION_ROWS,
                        K.VERSION_STATES,
                        K.ALL_VERSIONS,
                    ]
                    self._fill_summary(keys=keys, args=[vkey, row], client=p)
                p.execute()
        self.r.set(K.SUMMARIES_FILLED, 1)
