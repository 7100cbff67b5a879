"""Every Redis key smoltorrent uses, declared once as a template.

All keys live under one prefix so a shared Redis can hold several clusters
(SMOLTORRENT_REDIS_PREFIX) and `redis-cli --scan --pattern 'smoltorrent:*'`
shows exactly what is ours. A version is addressed by its version key
(`vkey`, Manifest.storage_key()): a digest of the checkpoint name and its
content id, so the same bytes under two names are two versions.
"""

from __future__ import annotations

import os

PREFIX = os.environ.get("SMOLTORRENT_REDIS_PREFIX", "smoltorrent") + ":"

# node_id -> JSON {address, added_at}
NODES = PREFIX + "nodes"
# TTL key per node: JSON of its last stat; absent = not heard from recently
NODE_ALIVE = PREFIX + "node:{node_id}:alive"
# TTL key per node a transfer could not reach (connect timed out, a stream stalled):
# the version's other transfers put their copies elsewhere instead of each waiting out
# the same timeout; gone when the node answers a probe again
NODE_UNREACHABLE = PREFIX + "node:{node_id}:unreachable"
# hash node_id -> unix time it last answered a probe (kept while it is registered, so a
# dead node still shows when it was last seen)
NODE_SEEN = PREFIX + "nodes:seen"
# hash node_id -> JSON of its latest scrub report as the scrub sweep saw it: running,
# passes, last_pass_finished, scrubbed_bytes, quarantined digests, bad_found (ever), at
NODE_SCRUB = PREFIX + "nodes:scrub"
# set of node ids the health sweep has declared dead (to log each death and return once)
NODES_DEAD = PREFIX + "nodes:dead"
# set per node of the vkeys whose manifest it may hold from versions removed while it was
# dead (a remove does not wait for a dead node): the crosscheck deletes each when the node
# answers again, and rebuild never restores one
MANIFESTS_OWED = PREFIX + "node:{node_id}:manifests_owed"

# set of checkpoint names
NAMES = PREFIX + "names"
# hash name -> vkey of the committed version gathers get by default
CURRENT = PREFIX + "current"
# hash name -> sequence number of the request that made the current version current
CURRENT_SEQ = PREFIX + "current:seq"
# zset of vkeys of one name, scored by the sequence number of their latest request
VERSIONS = PREFIX + "name:{name}:versions"

# What `ls` and `status` read instead of every version's hash and manifest, kept by the
# same scripts that change a version (so one HGETALL each lists 10,000 versions):
# hash vkey -> JSON of a listed version's fields that never change once it is created
# (name, version_id, size, shards, tensors, replicas, transfers, created_at, digests: each
# shard's blob in order)
VERSION_ROWS = PREFIX + "versions:rows"
# hash vkey -> state of every listed version (pending, committed, aborted, removing)
VERSION_STATES = PREFIX + "versions:states"
# zset of every listed version's vkey, scored like VERSIONS (the order `ls` shows)
ALL_VERSIONS = PREFIX + "versions:all"
# set once the three above hold the versions recorded before they existed (see
# Listing.version_summaries)
SUMMARIES_FILLED = PREFIX + "versions:summaries_filled"
# string JSON {"v": [vkey...], "d": [digest...]}: the keys the last listing had to pass in
# a second run (versions not committed, placements not listed), passed by the next
# listing in its first run; a hint only (any key it names may be gone), so it expires
LISTING_HINT = PREFIX + "versions:listing_hint"

# hash vkey -> unix time it was pinned: retention (per name, per prefix) never removes it
PINS = PREFIX + "pins"
# hash vkey -> its labels, space-separated (`tag NAME VERSION LABEL`, `gather NAME@LABEL`);
# a label names one version of a name at a time
TAGS = PREFIX + "tags"
# hash prefix (ending in "/") -> K: the retention sweep keeps the K newest entries under it
# (a name, or a folder of names), see beat/retention.py
RETAIN = PREFIX + "retain"

# counter: one sequence number per accepted request (orders a name's versions)
SEQ = PREFIX + "seq"
# hash: kind, host, seq, state, args (JSON), vkey, error, boot, times
REQUEST = PREFIX + "request:{rid}"
# zset of request ids not yet done or failed, scored by sequence number
REQUESTS_OPEN = PREFIX + "requests:open"
# lists a waiter blocks on (BLPOP) for the end of a request (pushed when it is closed) and
# for a version's commit: the CLI learns it at once instead of at its next poll. A hint
# only (coordinator/state/wakeups.py), so they expire; outside "request:" and "version:",
# whose keys are hashes and strings that scans read as such
REQUEST_WAKE = PREFIX + "wake:request:{rid}"
VERSION_WAKE = PREFIX + "wake:version:{vkey}"

# hash: name, version_id, state, seq, path, host, sizes, source identity, times
# (a removed version keeps only name, state and removed_at, until it expires)
VERSION = PREFIX + "version:{vkey}"
# the manifest JSON (schema in coordinator/plan/manifest.py)
MANIFEST = PREFIX + "version:{vkey}:manifest"
# a manifest JSON a store writes in pieces (token: one per call), which the script that
# records its version renames to MANIFEST whole; never read as a manifest, it expires
# (MANIFEST_STAGED_TTL_S) if that script never ran. Outside "version:" (see above)
MANIFEST_STAGED = PREFIX + "staged:manifest:{vkey}:{token}"
# hash shard index -> JSON list of target node ids (the placement plan)
PLAN = PREFIX + "version:{vkey}:plan"
# hash shard index -> its blob span JSON (coordinator/plan/blob_spans.py): what a transfer of
# that shard reads instead of the whole manifest; kept while the version is pending (TTL,
# dropped at commit), rebuilt from the manifest when absent
SPANS = PREFIX + "version:{vkey}:spans"
# set of "shard:replica" transfers that finished, well or badly
SETTLED = PREFIX + "version:{vkey}:settled"
# set of shard indexes with at least one verified replica
READY = PREFIX + "version:{vkey}:ready"
# hash "shard:replica" -> bytes of the blob sent so far by its running transfer (for
# progress bars); expires on its own, being only a view of work in flight
SENT = PREFIX + "version:{vkey}:sent"
# hash raw_bytes, wire_bytes -> what the source's transfers of a version delivered so far
# (raw, as in the checkpoint) and put on the wire for it; read by the CLI at commit, so it
# expires like SENT
WIRE = PREFIX + "version:{vkey}:wire"
# list of JSON {shard, replica, node, attempt, at, error} per transfer attempt
ATTEMPTS = PREFIX + "version:{vkey}:attempts"
# zset reader id -> expiry (ms, Redis server clock) of every gather reading a version;
# retention never removes a version with an unexpired reader
READERS = PREFIX + "version:{vkey}:readers"

# set of node ids holding a verified copy of a blob
PLACEMENT = PREFIX + "blob:{digest}:nodes"
# hash digest -> its placement's node ids, space-separated: a copy the listing keeps so `ls`
# reads many placements in one request. Every script changing a placement drops the blob's
# field in the same step, and the listing fills it again from the set (non-empty only), so
# a field present always equals its set.
PLACEMENTS_LISTED = PREFIX + "blobs:listed"
# set of vkeys of the versions (not removing or removed) whose manifest uses a blob
BLOB_REFS = PREFIX + "blob:{digest}:refs"
# tombstone: a remove is deleting this unreferenced blob from the nodes right now
BLOB_DELETING = PREFIX + "blob:{digest}:deleting"
# hash raw SHA-256 of a chunk -> "blob_sha256 blob_size" of the encoded chunk that holds it:
# how a store finds the chunks already stored (coordinator/state/chunks.py)
CHUNKS = PREFIX + "chunks"
# mark on one node's copy of a blob that a trim is deleting right now (expires on its own,
# defaults.TRIM_MARK_TTL_S): no transfer may count a copy there until it is cleared
TRIM_MARK = PREFIX + "trim:{digest}:{node_id}"
# set of blob digests a removing version left unreferenced, still to delete from nodes
REMOVE_BLOBS = PREFIX + "version:{vkey}:remove_blobs"
# set of node ids that were sent (or were found holding) a copy of a version's manifest:
# its blob holders, extra holders of an under-replicated commit, nodes whose blob copies
# were trimmed since. A remove waits for every one of them (tasks/remove.py): a copy left
# on any of them lets a rebuild bring the version back
MANIFEST_NODES = PREFIX + "version:{vkey}:manifest_nodes"
# hash "digest:node_id" -> when (Redis clock, s) the crosscheck first found that node holding
# a blob no version uses; collected once older than the grace period
ORPHANS = PREFIX + "orphans"
# hash "digest:node_id" -> JSON {reason, at}: copies a reader found corrupt, to repair
BAD_COPIES = PREFIX + "bad_copies"

# hash "digest:target" -> JSON {source, size, at, deadline}: repair copies sent and not
# yet finished (the throttle counts them; a record past its deadline is a dead task's)
REPAIRS = PREFIX + "repairs"
# hash "digest:target" (a session's first copy) -> JSON {host, boot, at, target, digests}:
# the worker (host and boot id) running that repair session, so its next boot frees the
# session's records if it died mid-copy (coordinator/state/repairs.py)
REPAIR_RUNNERS = PREFIX + "repairs:runners"
# lock held while one planner decides and claims repairs (beat/repair.py send_repairs)
REPAIR_PLAN_LOCK = PREFIX + "repairs:plan_lock"
# hash digest -> JSON {copies, replicas, reason, names}: blobs below R that no repair can
# raise now (fewer live nodes than R, no reachable copy, no space), rewritten every pass
UNREPAIRABLE = PREFIX + "unrepairable"
# hash "digest:target" -> JSON {failures, until, error}: repair copies that failed, waiting
# out a doubling backoff before that target is sent that copy again
REPAIR_BACKOFF = PREFIX + "repairs:backoff"
# hash counter -> number: repairs done, copies trimmed (for status and the closing note)
REPAIR_COUNTS = PREFIX + "repairs:counts"
# hash of one step of a per-rank sharded checkpoint: world_size, state, parts (count),
# created_at, committed_at, and "rank:<r>" -> JSON of that rank's version
STEP = PREFIX + "sharded:{name}:step:{step}"
# zset of a sharded checkpoint's recorded steps, scored by step number
STEPS = PREFIX + "sharded:{name}:steps"

# hash of a directory checkpoint (Hugging Face layout): "current" -> its current directory
# version id, "version:<id>" -> JSON {files: {file: {vkey, version_id, size}}, index_name,
# index (text), created_at}
DIRECTORY = PREFIX + "directory:{name}"

# TTL key per host: the boot id of the worker serving it, refreshed while it runs
WORKER_ALIVE = PREFIX + "worker:{host}:alive"
# set by `smoltorrent worker` as it starts, before Celery boots (TTL WORKER_START_GRACE_S):
# a command asking for this host's worker meanwhile waits for it instead of failing
WORKER_STARTING = PREFIX + "worker:{host}:starting"
# set of the hosts whose workers ever set an alive key (pruned once the key expired), so
# the reconcile sweep finds the live workers without scanning the keyspace
WORKER_HOSTS = PREFIX + "workers"
# lock held while one sweep runs, so two beat instances never run it twice at once
SWEEP_LOCK = PREFIX + "sweep:{name}:lock"
# list of JSON {started, finished, by, outcome} of a sweep's latest runs (Redis clock, s)
SWEEP_RUNS = PREFIX + "sweep:{name}:runs"
# counter: times a sweep stood down because another run held its lock
SWEEP_SKIPPED = PREFIX + "sweep:{name}:skipped"

# hash task_id -> JSON dead-letter record; stream as a time-ordered index
DLQ = PREFIX + "dlq"
DLQ_STREAM = PREFIX + "dlq:stream"
# set of the task ids of one version's dead letters, so a remove drops them without reading
# the whole queue
DLQ_OF = PREFIX + "dlq:version:{vkey}"
# list of JSON {seconds, raw_bytes, wire_bytes} of gathers a host ran in its own process
# (the CLI, load()), which that host's worker adds to its metrics at its next scrape
PROCESS_GATHERS = PREFIX + "host:{host}:process_gathers"
