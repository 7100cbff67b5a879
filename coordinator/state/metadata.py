"""Placement metadata in Redis: nodes, versions, manifests, placement, dead letters.

Every key comes from coordinator/state/redis_keys.py. Writes that must be atomic
(the commit barrier, the commit flip) are Lua scripts or MULTI blocks, so a
retry, a redelivery or two workers racing leave the same state.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from coordinator import config
from coordinator.dataplane.node_client import NodeAddress
from coordinator.plan.manifest import BlobSpan, Manifest, VersionBlobs, blob_spans
from coordinator.state import redis_keys as K
from smoltorrent import defaults
from smoltorrent.errors import CopyBeingTrimmedError, MetadataError, NotFoundError

PENDING, COMMITTED, ABORTED = "pending", "committed", "aborted"
_HEX = re.compile("[0-9a-f]+")
REMOVING, REMOVED = "removing", "removed"
# Request (intent) states: queued until a task picks it up, running, then done or failed.
QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"

# Every version state change below is one compare-and-set script:
#   pending -> committed | aborted;  committed | pending | aborted -> removing -> removed.
# Nothing ever moves committed -> aborted, and nothing leaves removing except to removed.

# Makes `vkey` the name's current version if its request is the latest accepted one.
# Shared by the scripts below; KEYS of the caller: current, current seq.
_MAKE_CURRENT = """
local function make_current(kcur, kseq, name, vkey, seq)
  local cur = redis.call('HGET', kcur, name)
  if cur == vkey then return 1 end
  if seq > tonumber(redis.call('HGET', kseq, name) or '0') then
    redis.call('HSET', kcur, name, vkey)
    redis.call('HSET', kseq, name, seq)
    return 1
  end
  return 0
end
"""

# Records a store request's version: a new pending version, or joins the existing one
# (the same bytes again), raising its sequence number to this request's; a committed
# version a later request asks for again becomes current (a rollback moves no bytes).
# The version joins the reference set of each of its blobs in the same step.
# KEYS: version, manifest, plan, settled, ready, attempts, names, versions zset,
#       current, current seq, listing rows, listing states, all versions zset,
#       summaries-filled marker, then the reference set of every blob
# ARGV: seq, name, vkey, fields JSON, manifest JSON, plan JSON (list of JSON strings),
#       listing row JSON
# Returns the state found ("pending", "committed", "removing") or "created".
_CREATE = (
    _MAKE_CURRENT
    + """
local seq = tonumber(ARGV[1])
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'removing' then return state end
for i = 15, #KEYS do redis.call('SADD', KEYS[i], ARGV[3]) end
if state == 'pending' or state == 'committed' then
  if seq > tonumber(redis.call('HGET', KEYS[1], 'seq') or '0') then
    redis.call('HSET', KEYS[1], 'seq', seq)
    redis.call('ZADD', KEYS[8], seq, ARGV[3])
    redis.call('ZADD', KEYS[13], seq, ARGV[3])
  end
  if state == 'committed' then make_current(KEYS[9], KEYS[10], ARGV[2], ARGV[3], seq) end
  return state
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
for k, v in pairs(cjson.decode(ARGV[4])) do redis.call('HSET', KEYS[1], k, v) end
redis.call('HSET', KEYS[1], 'state', 'pending', 'seq', seq)
redis.call('SET', KEYS[2], ARGV[5])
for i, t in ipairs(cjson.decode(ARGV[6])) do redis.call('HSET', KEYS[3], tostring(i - 1), t) end
-- No name yet: nothing recorded before the listing summaries, none to fill.
if redis.call('SCARD', KEYS[7]) == 0 then redis.call('SET', KEYS[14], 1) end
redis.call('SADD', KEYS[7], ARGV[2])
redis.call('ZADD', KEYS[8], seq, ARGV[3])
redis.call('HSET', KEYS[11], ARGV[3], ARGV[7])
redis.call('HSET', KEYS[12], ARGV[3], 'pending')
redis.call('ZADD', KEYS[13], seq, ARGV[3])
return 'created'
"""
)

# Records one settled transfer and says whether the set is complete. A transfer for a
# committed version still adds its replica (a replay restoring R) but changes no state;
# one for a removing, removed or unknown version records nothing. The caller enqueues the
# commit and only then marks commit_enqueued, so a crash in between leaves a complete
# barrier without the mark, which the reconcile sweep finds and commits.
# A replica on a copy a trim is deleting (its mark stands), or one the caller counted from
# the placement without sending (held) on a node no longer in it, is refused (-1): the
# caller sends the blob there again (why every order is safe: coordinator/state/trim_marks.py).
# KEYS: settled, ready, version hash, blob placement, trim mark of (blob, node), placements
#       listed
# ARGV: "shard:replica", shard index ("" when the transfer failed), node id,
#       number of transfers, number of shards, "1" if held, digest
_BARRIER = """
local state = redis.call('HGET', KEYS[3], 'state')
if state ~= 'pending' and state ~= 'committed' and state ~= 'aborted' then return 0 end
if ARGV[2] ~= '' and (redis.call('EXISTS', KEYS[5]) == 1
    or (ARGV[6] == '1' and redis.call('SISMEMBER', KEYS[4], ARGV[3]) == 0)) then
  return -1
end
if ARGV[2] ~= '' and redis.call('SADD', KEYS[4], ARGV[3]) == 1 then
  redis.call('HDEL', KEYS[6], ARGV[7])
end
if state ~= 'pending' then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('SADD', KEYS[2], ARGV[2]) end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[4])
   and redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[5])
   and not redis.call('HGET', KEYS[3], 'commit_enqueued') then
  return 1
end
return 0
"""

# Swaps one node of a pending version's shard plan for another, if it is still the old one.
# KEYS: version hash, plan; ARGV: shard index, replica (1-based), old node id, new node id
_REPLACE_TARGET = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then return 0 end
local nodes = cjson.decode(raw)
local at = tonumber(ARGV[2])
if nodes[at] ~= ARGV[3] then return 0 end
nodes[at] = ARGV[4]
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(nodes))
return 1
"""

# pending -> committed, then current if its request is the latest accepted one.
# KEYS: version hash, current, current seq, listing states; ARGV: name, vkey, now
# Returns {state after, 1 if current}.
_COMMIT = (
    _MAKE_CURRENT
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'pending' then
  redis.call('HSET', KEYS[1], 'state', 'committed', 'committed_at', ARGV[3], 'reason', '')
  redis.call('HSET', KEYS[4], ARGV[2], 'committed')
  state = 'committed'
elseif state ~= 'committed' then
  return {state or 'missing', 0}
end
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
return {state, make_current(KEYS[2], KEYS[3], ARGV[1], ARGV[2], seq)}
"""
)

# pending -> aborted, with its reason; 1 if this call aborted it.
# KEYS: version hash, listing states; ARGV: reason, vkey
_ABORT = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'aborted', 'reason', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], 'aborted')
return 1
"""

# pending | committed | aborted -> removing. The version leaves the reference set of each
# of its blobs; a blob no version uses any more gets a tombstone (a store that needs it
# meanwhile waits, then sends it again) and goes on the list the remove deletes. If it
# was the name's current version, the latest other committed version becomes current.
# Shared by the remove and retire scripts below; blob keys in pairs from KEYS[b], their
# digests from ARGV[a].
# KEYS: version hash, versions zset, current, current seq, version-key prefix,
#       blobs-to-delete set, listing states, ..., then per blob its reference set and its
#       tombstone
# ARGV: name, vkey, now, tombstone ttl seconds, ..., then the digest of every blob
_BEGIN_REMOVE_FN = """
local function begin_remove(b, a)
  redis.call('HSET', KEYS[1], 'state', 'removing', 'removing_at', ARGV[3])
  redis.call('HSET', KEYS[7], ARGV[2], 'removing')
  for i = b, #KEYS, 2 do
    redis.call('SREM', KEYS[i], ARGV[2])
    if redis.call('SCARD', KEYS[i]) == 0 then
      redis.call('SET', KEYS[i + 1], ARGV[2], 'EX', tonumber(ARGV[4]))
      redis.call('SADD', KEYS[6], ARGV[a + (i - b) / 2])
    end
  end
  if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then
    redis.call('HDEL', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
    local vkeys = redis.call('ZREVRANGE', KEYS[2], 0, -1)
    for _, v in ipairs(vkeys) do
      if v ~= ARGV[2] and redis.call('HGET', KEYS[5] .. v, 'state') == 'committed' then
        redis.call('HSET', KEYS[3], ARGV[1], v)
        redis.call('HSET', KEYS[4], ARGV[1], redis.call('HGET', KEYS[5] .. v, 'seq') or '0')
        break
      end
    end
  end
end
"""

# The time on the Redis server in ms: reader marks are set and checked on one clock,
# whatever the clocks of the hosts that gather.
_NOW_MS = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# A remove asked for (rm): any version not already removing or removed. Returns the
# state found. KEYS and ARGV as begin_remove, blobs from KEYS[8] and ARGV[5].
_REMOVE_BEGIN = (
    _BEGIN_REMOVE_FN
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'pending' and state ~= 'committed' and state ~= 'aborted' then
  return state or 'missing'
end
begin_remove(8, 5)
return state
"""
)

# Retention: committed -> removing only if the version is not current, no gather holds an
# unexpired reader mark on it, and at least `keep` newer committed versions of its name
# exist; aborted -> removing once a newer committed version exists. Checked and done in
# one step, so a gather taking its mark or a store making the version current again
# either happens before (and the version stays) or finds it removing.
# KEYS: as begin_remove, then KEYS[8] its readers, blobs from KEYS[9]
# ARGV: as begin_remove, then ARGV[5] keep, digests from ARGV[6]
# Returns "retired", or why not: "current", "reading", "kept" or the state found.
_RETIRE = (
    _BEGIN_REMOVE_FN
    + _NOW_MS
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'committed' and state ~= 'aborted' then return state or 'missing' end
if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then return 'current' end
redis.call('ZREMRANGEBYSCORE', KEYS[8], '-inf', now_ms())
if redis.call('ZCARD', KEYS[8]) > 0 then return 'reading' end
local newer = 0
for _, v in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, -1)) do
  if v == ARGV[2] then break end
  if redis.call('HGET', KEYS[5] .. v, 'state') == 'committed' then newer = newer + 1 end
end
if state == 'committed' and newer < tonumber(ARGV[5]) then return 'kept' end
if state == 'aborted' and newer == 0 then return 'kept' end
begin_remove(9, 6)
return 'retired'
"""
)

# A gather's reader mark on a committed version, set or refreshed until now + ttl; the
# state found (no mark unless "committed"). KEYS: version hash, readers
# ARGV: reader id, ttl ms
_READ = (
    _NOW_MS
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'committed' then return state or 'missing' end
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]))
return state
"""
)

# removing -> removed: the last step of a remove, once the nodes are clean. The version's
# keys go; a small tombstone stays so late transfers and commits see "removed".
# KEYS: version, manifest, plan, settled, ready, attempts, versions zset, names,
#       blobs-to-delete set, listing rows, listing states, all versions zset
# ARGV: name, vkey, now, tombstone ttl seconds
_REMOVE_FINISH = """
if redis.call('HGET', KEYS[1], 'state') ~= 'removing' then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[9])
redis.call('HDEL', KEYS[10], ARGV[2])
redis.call('HDEL', KEYS[11], ARGV[2])
redis.call('ZREM', KEYS[12], ARGV[2])
redis.call('HSET', KEYS[1], 'name', ARGV[1], 'state', 'removed', 'removed_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('ZREM', KEYS[7], ARGV[2])
if redis.call('ZCARD', KEYS[7]) == 0 then redis.call('SREM', KEYS[8], ARGV[1]) end
return 1
"""

# A blob deleted from the nodes `ARGV` by a remove: they leave its placement; with no
# version using it any more, its placement goes entirely (Redis stays bounded). The
# tombstone goes last, so a store waiting on it then sends the blob afresh.
# KEYS: placement, reference set, tombstone, the remove's blobs-to-delete set, placements
#       listed
# ARGV: digest, then the node ids it was deleted from
_BLOB_DELETED = """
for i = 2, #ARGV do redis.call('SREM', KEYS[1], ARGV[i]) end
redis.call('HDEL', KEYS[5], ARGV[1])
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[1]) end
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""

# The crosscheck claims a blob no version uses before deleting it from a node: the same
# tombstone a remove sets, so a store that starts using the blob meanwhile waits, then sends
# it again; a blob with a reference or a tombstone already is not claimed. 1 if claimed.
# KEYS: reference set, tombstone; ARGV: owner, tombstone ttl seconds
_CLAIM_ORPHAN = """
if redis.call('SCARD', KEYS[1]) > 0 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'EX', tonumber(ARGV[2]))
return 1
"""

# A copy found on a node that placement does not list: recorded only if a version uses
# the blob (checked in the same step, so a remove emptying its references wins). 1 if added.
# KEYS: placement, reference set, placements listed; ARGV: node id, digest
_RECORD_COPY = """
if redis.call('SCARD', KEYS[2]) == 0 then return 0 end
redis.call('HDEL', KEYS[3], ARGV[2])
return redis.call('SADD', KEYS[1], ARGV[1])
"""

# An orphan deleted from the nodes ARGV: they leave its placement (all of it, if still no
# version uses it), its orphan marks go, and its tombstone, if this crosscheck set it.
# KEYS: placement, reference set, tombstone, orphans hash, placements listed
# ARGV: owner, digest, node ids
_ORPHAN_DELETED = """
redis.call('HDEL', KEYS[5], ARGV[2])
for i = 3, #ARGV do
  redis.call('SREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[2] .. ':' .. ARGV[i])
end
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[1]) end
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
return 1
"""

# A pending version's shards found with no copy at commit time go back to unsettled, so
# their transfers run again and the barrier fires again. KEYS: version, settled, ready
# ARGV: then per lost shard, its index and its number of replicas
_REOPEN = """
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
for i = 1, #ARGV, 2 do
  redis.call('SREM', KEYS[3], ARGV[i])
  for r = 0, tonumber(ARGV[i + 1]) - 1 do redis.call('SREM', KEYS[2], ARGV[i] .. ':' .. r) end
end
redis.call('HDEL', KEYS[1], 'commit_enqueued')
return 1
"""

# A new request (intent): its sequence number from the one counter, its record, and its
# place among the open requests, in one step. KEYS: seq counter, request, open zset
# ARGV: kind, host, args JSON, now, request id. Returns the sequence number.
_OPEN_REQUEST = """
local seq = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], 'kind', ARGV[1], 'host', ARGV[2], 'args', ARGV[3],
           'state', 'queued', 'seq', seq, 'created_at', ARGV[4])
redis.call('ZADD', KEYS[3], seq, ARGV[5])
return seq
"""

# queued | running | failed -> running, by the task that picked the request up (a replay
# or a re-drive runs it again); a done request stays done. Returns the state found.
# KEYS: request; ARGV: boot id of the worker, now
_START_REQUEST = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'done' then return state or 'missing' end
redis.call('HSET', KEYS[1], 'state', 'running', 'boot', ARGV[1], 'started_at', ARGV[2])
return state
"""


# A version recorded before the listing summaries existed gets its row, state and place in
# the all-versions zset, unless it left the listing meanwhile (the same step, so a state
# change cannot interleave). KEYS: version hash, versions zset of its name, listing rows,
# listing states, all versions zset; ARGV: vkey, listing row JSON. 1 if filled.
_FILL_SUMMARY = """
local state = redis.call('HGET', KEYS[1], 'state')
local seq = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not state or state == 'removed' or not seq then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], state)
redis.call('ZADD', KEYS[5], seq, ARGV[1])
return 1
"""

# One slice of a listing, as the text of a JSON list (one reply parses far faster than
# thousands of small ones): for each version at ranks ARGV[1]..ARGV[2] of the zset KEYS[1]
# that has a listing row (only the notable ones if ARGV[6] has "n": pending, committed with
# a shard under its replicas, or using one of the blobs listed last), that row (with its
# digests only if ARGV[6] has "d") with "vkey", "state", "current", "transfers_settled"
# (not counted for a committed version, whose barrier fired: all of them), "reason"
# (aborted only), "copies" (per shard, how many of the nodes `among` its placement lists),
# "min_copies", "under_replicated" (shards with fewer copies than its replicas) and "live"
# (copies per shard among the nodes `live`, if given) added: the row `ls` shows, built here
# so the client only parses it. Placements are read from their listed copies (KEYS[5]) in
# one request per slice, a missing one from its set (then kept there): one request per
# blob made up most of a listing's time.
# KEYS: versions zset, listing rows, listing states, current, placements listed
# ARGV: start, stop, version-key prefix, placement key head and tail, options ("d", "n"),
#       number of nodes among, their ids, number of live nodes (-1: not asked), their ids,
#       then the blobs that make a version notable
_LISTING = """
local with_digests = string.find(ARGV[6], 'd', 1, true) ~= nil
local notable_only = string.find(ARGV[6], 'n', 1, true) ~= nil
local among, live, wanted = {}, nil, {}
local n = tonumber(ARGV[7])
for i = 8, 7 + n do among[ARGV[i]] = true end
local m = tonumber(ARGV[8 + n])
if m >= 0 then
  live = {}
  for i = 9 + n, 8 + n + m do live[ARGV[i]] = true end
end
for i = 9 + n + math.max(m, 0), #ARGV do wanted[ARGV[i]] = true end
local function many(key, fields)  -- HMGET in chunks (Lua's unpack has a limit)
  local out = {}
  for i = 1, #fields, 1000 do
    local got = redis.call('HMGET', key, unpack(fields, i, math.min(i + 999, #fields)))
    for j = 1, #got do out[i + j - 1] = got[j] end
  end
  return out
end
local vkeys = redis.call('ZRANGE', KEYS[1], ARGV[1], ARGV[2])
if #vkeys == 0 then return '[]' end
local raws, states = many(KEYS[2], vkeys), many(KEYS[3], vkeys)
local rows, blobs, seen = {}, {}, {}
for k, vkey in ipairs(vkeys) do
  local raw, state = raws[k], states[k]
  if raw and state then
    -- The row is written by _listing_row: name first, digests last, each digest 64 hex
    -- digits in quotes. Plain finds, then matches anchored there: far cheaper than
    -- decoding it, or than a pattern tried at every byte (a quote inside a name is escaped,
    -- so cannot match).
    local row = {raw = raw, state = state, vkey = vkey, digests = {}}
    row.name = string.match(raw, '^{"name":(".-"),"version_id":')
    local at = string.find(raw, ',"replicas":', 1, true)
    row.replicas = tonumber(string.match(raw, '^%d+', at + 12))
    at = string.find(raw, ',"transfers":', at, true)
    row.settled = string.match(raw, '^%d+', at + 13)
    row.at = string.find(raw, ',"digests":[', at, true)
    for i = row.at + 13, #raw - 2, 67 do
      local d = string.sub(raw, i, i + 63)
      row.digests[#row.digests + 1] = d
      if not seen[d] then seen[d] = true; blobs[#blobs + 1] = d end
    end
    rows[#rows + 1] = row
  end
end
local holders = {}  -- digest -> its placement, node ids space-separated
local listed = many(KEYS[5], blobs)
for i, d in ipairs(blobs) do
  local h = listed[i]
  if not h then
    h = table.concat(redis.call('SMEMBERS', ARGV[4] .. d .. ARGV[5]), ' ')
    if h ~= '' then redis.call('HSET', KEYS[5], d, h) end
  end
  holders[d] = h
end
-- Copies per shard among `nodes`; a placement's count is worked out once per distinct
-- placement (a handful of node sets hold every blob).
local function counter(nodes)
  local memo = {}
  return function(digests)
    local out = {}
    for i, d in ipairs(digests) do
      local h = holders[d]
      local c = memo[h]
      if c == nil then
        c = 0
        for node in string.gmatch(h, '%S+') do
          if nodes[node] then c = c + 1 end
        end
        memo[h] = c
      end
      out[i] = c
    end
    return out
  end
end
local copies_among, copies_live = counter(among), live and counter(live)
-- Whether a row is shown when only the notable ones are asked for.
local function notable(row, copies, live_copies)
  if not notable_only or row.state == 'pending' then return true end
  if row.state == 'committed' then
    for _, c in ipairs(live_copies or copies) do
      if c < row.replicas then return true end
    end
  end
  for _, d in ipairs(row.digests) do
    if wanted[d] then return true end
  end
  return false
end
local current = {}  -- name (as JSON) -> its current vkey, read once per name
local out = {}
for _, row in ipairs(rows) do
  local copies = copies_among(row.digests)
  local live_copies = live and copies_live(row.digests)
  if notable(row, copies, live_copies) then
    local name, state, vkey = row.name, row.state, row.vkey
    if current[name] == nil then
      current[name] = redis.call('HGET', KEYS[4], cjson.decode(name)) or false
    end
    local settled, reason = row.settled, '""'
    if state ~= 'committed' then
      settled = redis.call('SCARD', ARGV[3] .. vkey .. ':settled')
    end
    if state == 'aborted' then
      reason = cjson.encode(redis.call('HGET', ARGV[3] .. vkey, 'reason') or '')
    end
    local least, under = row.replicas, {}
    for i, c in ipairs(copies) do
      if c < least then least = c end
      if c < row.replicas then under[#under + 1] = i - 1 end
    end
    local raw = row.raw
    out[#out + 1] = (with_digests and string.sub(raw, 1, -2) or string.sub(raw, 1, row.at - 1))
      .. ',"vkey":"' .. vkey .. '","state":"' .. state
      .. '","current":' .. tostring(current[name] == vkey)
      .. ',"transfers_settled":' .. settled .. ',"reason":' .. reason
      .. ',"copies":[' .. table.concat(copies, ',') .. ']'
      .. ',"min_copies":' .. least
      .. ',"under_replicated":[' .. table.concat(under, ',') .. ']'
      .. ',"live":' .. (live_copies and '[' .. table.concat(live_copies, ',') .. ']' or 'null')
      .. '}'
  end
end
return '[' .. table.concat(out, ',') .. ']'
"""


def _listing_row(manifest: Manifest, transfers: int) -> str:
    """The fields `ls` shows of a version that never change once it is recorded (JSON, name
    first and digests last: _LISTING finds them there without decoding it)."""
    return json.dumps(
        {
            "name": manifest.name,
            "version_id": manifest.version_id,
            "size": manifest.source_size,
            "shards": len(manifest.shards),
            "tensors": sum(len(s.tensors) for s in manifest.shards),
            "replicas": manifest.replicas,
            "transfers": transfers,
            "created_at": manifest.created_at,
            "digests": [s.blob_sha256 for s in manifest.shards],
        },
        separators=(",", ":"),
    )


def _vkey_of_task(task_id: str) -> str | None:
    """The version a task works on, from its id ("transfer-<vkey>-...", see tasks/enqueue.py)."""
    parts = task_id.split("-")
    if len(parts) > 1 and len(parts[1]) == 32 and _HEX.fullmatch(parts[1]):
        return parts[1]
    return None


def _digests(manifest: Manifest) -> list[str]:
    """Each distinct blob of a manifest once, in shard order."""
    return list(dict.fromkeys(s.blob_sha256 for s in manifest.shards))


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    address: NodeAddress
    added_at: float


class Metadata:
    def __init__(self, url: str) -> None:
        self.url = url
        self.r = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=defaults.REDIS_TIMEOUT_S,
            socket_connect_timeout=defaults.REDIS_TIMEOUT_S,
        )
        self._create = self.r.register_script(_CREATE)
        self._barrier = self.r.register_script(_BARRIER)
        self._replace_target = self.r.register_script(_REPLACE_TARGET)
        self._commit = self.r.register_script(_COMMIT)
        self._abort = self.r.register_script(_ABORT)
        self._remove_begin = self.r.register_script(_REMOVE_BEGIN)
        self._retire = self.r.register_script(_RETIRE)
        self._read = self.r.register_script(_READ)
        self._claim_orphan = self.r.register_script(_CLAIM_ORPHAN)
        self._record_copy = self.r.register_script(_RECORD_COPY)
        self._orphan_deleted = self.r.register_script(_ORPHAN_DELETED)
        self._remove_finish = self.r.register_script(_REMOVE_FINISH)
        self._blob_deleted = self.r.register_script(_BLOB_DELETED)
        self._reopen = self.r.register_script(_REOPEN)
        self._open_request = self.r.register_script(_OPEN_REQUEST)
        self._fill_summary = self.r.register_script(_FILL_SUMMARY)
        self._listing = self.r.register_script(_LISTING)
        self._start_request = self.r.register_script(_START_REQUEST)

    def ping(self) -> None:
        try:
            self.r.ping()
        except redis.RedisError as exc:
            raise MetadataError(
                f"cannot reach Redis at {config.shown_url(self.url)} ({exc}). Start it, or unset "
                "SMOLTORRENT_REDIS_URL to let smoltorrent run its own."
            ) from exc

    # --- nodes ---------------------------------------------------------------

    def add_node(self, node_id: str, address: NodeAddress) -> None:
        self.r.hset(
            K.NODES, node_id, json.dumps({"address": str(address), "added_at": time.time()})
        )

    def remove_node(self, node_id: str) -> bool:
        with self.r.pipeline() as p:
            p.delete(K.NODE_ALIVE.format(node_id=node_id))
            p.hdel(K.NODE_SEEN, node_id)
            p.hdel(K.NODE_SCRUB, node_id)
            p.srem(K.NODES_DEAD, node_id)
            p.hdel(K.NODES, node_id)
            *_, removed = p.execute()
        return bool(removed)

    def nodes(self) -> dict[str, NodeRecord]:
        out = {}
        for node_id, raw in self.r.hgetall(K.NODES).items():
            data = json.loads(raw)
            out[node_id] = NodeRecord(node_id, NodeAddress.parse(data["address"]), data["added_at"])
        return out

    def mark_alive(self, node_id: str, stat: dict) -> None:
        """The node answered just now: up for NODE_ALIVE_TTL_S, and last seen now."""
        with self.r.pipeline() as p:
            p.set(
                K.NODE_ALIVE.format(node_id=node_id),
                json.dumps(stat),
                ex=defaults.NODE_ALIVE_TTL_S,
            )
            p.hset(K.NODE_SEEN, node_id, repr(time.time()))
            p.execute()

    def last_seen(self) -> dict[str, float]:
        """Node id -> unix time it last answered, for every node that ever did."""
        return {n: float(t) for n, t in self.r.hgetall(K.NODE_SEEN).items()}

    def declared_dead(self) -> set[str]:
        """Nodes the health sweep declared dead and has not seen come back."""
        return set(self.r.smembers(K.NODES_DEAD))

    def declare_dead(self, node_id: str) -> bool:
        """True the first time a node is declared dead (until it comes back)."""
        return bool(self.r.sadd(K.NODES_DEAD, node_id))

    def readmit(self, node_id: str) -> bool:
        """True if the node was declared dead and is now back."""
        return bool(self.r.srem(K.NODES_DEAD, node_id))

    def mark_down(self, node_id: str) -> None:
        self.r.delete(K.NODE_ALIVE.format(node_id=node_id))

    def alive(self, node_ids: Iterable[str]) -> dict[str, dict]:
        """Last stat of every node heard from within NODE_ALIVE_TTL_S."""
        ids = list(node_ids)
        if not ids:
            return {}
        raws = self.r.mget([K.NODE_ALIVE.format(node_id=n) for n in ids])
        return {n: json.loads(raw) for n, raw in zip(ids, raws, strict=True) if raw}

    # --- versions ------------------------------------------------------------

    def create_pending(
        self,
        manifest: Manifest,
        vkey: str,
        fields: dict,
        plan: list[tuple[str, ...]],
        seq: int | None = None,
    ) -> str:
        """Record the version a store request asks for, ordered by the request's sequence
        number (a fresh one if not given). Returns "created" for a new pending version
        (also over an aborted or removed one), else the state of the existing version it
        joined: "pending", "committed" (made current again if this request is the latest
        for the name) or "removing" (the caller waits for the remove to finish)."""
        if seq is None:
            seq = self.next_seq()
        keys = self._version_keys(vkey)
        return self._create(
            keys=[
                *keys,
                K.NAMES,
                K.VERSIONS.format(name=manifest.name),
                K.CURRENT,
                K.CURRENT_SEQ,
                K.VERSION_ROWS,
                K.VERSION_STATES,
                K.ALL_VERSIONS,
                K.SUMMARIES_FILLED,
                *(K.BLOB_REFS.format(digest=d) for d in _digests(manifest)),
            ],
            args=[
                seq,
                manifest.name,
                vkey,
                json.dumps(
                    {
                        **{k: str(v) for k, v in fields.items()},
                        "name": manifest.name,
                        "version_id": manifest.version_id,
                        "size": str(manifest.source_size),
                        "shards": str(len(manifest.shards)),
                        "replicas": str(manifest.replicas),
                        "transfers": str(sum(len(t) for t in plan)),
                        "created_at": repr(manifest.created_at),
                    }
                ),
                manifest.to_json(),
                json.dumps([json.dumps(list(t)) for t in plan]),
                _listing_row(manifest, sum(len(t) for t in plan)),
            ],
        )

    @staticmethod
    def _version_keys(vkey: str) -> list[str]:
        """version, manifest, plan, settled, ready, attempts: every per-version key."""
        return [
            K.VERSION.format(vkey=vkey),
            K.MANIFEST.format(vkey=vkey),
            K.PLAN.format(vkey=vkey),
            K.SETTLED.format(vkey=vkey),
            K.READY.format(vkey=vkey),
            K.ATTEMPTS.format(vkey=vkey),
        ]

    def next_seq(self) -> int:
        """A new sequence number from the one counter that orders requests."""
        return int(self.r.incr(K.SEQ))

    def version(self, vkey: str) -> dict[str, str]:
        data = self.r.hgetall(K.VERSION.format(vkey=vkey))
        if not data:
            raise NotFoundError(
                f"no version {vkey} in the metadata; list them with `smoltorrent ls`."
            )
        return data

    def manifest(self, vkey: str) -> Manifest:
        raw = self.r.get(K.MANIFEST.format(vkey=vkey))
        if raw is None:
            raise NotFoundError(
                f"no manifest for version {vkey}; if Redis was lost, run `smoltorrent rebuild`."
            )
        return Manifest.from_json(raw)

    def version_blobs(self, vkeys: Iterable[str]) -> dict[str, VersionBlobs]:
        """vkey -> its name, replicas and blobs (from its manifest), for those of `vkeys`
        that have one (a version removed meanwhile is left out): one round trip per
        LISTING_BATCH_VERSIONS, not per version."""
        vkeys = list(vkeys)
        out: dict[str, VersionBlobs] = {}
        batch = defaults.LISTING_BATCH_VERSIONS
        for start in range(0, len(vkeys), batch):
            chunk = vkeys[start : start + batch]
            with self.r.pipeline(transaction=False) as p:
                for vkey in chunk:
                    p.get(K.MANIFEST.format(vkey=vkey))
                raws = p.execute()
            out.update(
                (vkey, VersionBlobs.from_json(raw))
                for vkey, raw in zip(chunk, raws, strict=True)
                if raw is not None
            )
        return out

    def keep_spans(self, vkey: str, spans: Iterable[BlobSpan]) -> None:
        """Record each shard's blob span for the transfers about to run."""
        mapping = {str(span.index): span.to_json() for span in spans}
        if not mapping:
            return
        with self.r.pipeline() as p:
            p.hset(K.SPANS.format(vkey=vkey), mapping=mapping)
            p.expire(K.SPANS.format(vkey=vkey), defaults.SPANS_TTL_S)
            p.execute()

    def span(self, vkey: str, shard: int) -> BlobSpan:
        """The blob span of one shard: read alone while the version's spans are kept, else
        rebuilt from the manifest (a replay after the commit dropped them)."""
        raw = self.r.hget(K.SPANS.format(vkey=vkey), str(shard))
        if raw is not None:
            return BlobSpan.from_json(raw)
        return blob_spans(self.manifest(vkey))[shard]

    def plan(self, vkey: str) -> list[tuple[str, ...]]:
        raw = self.r.hgetall(K.PLAN.format(vkey=vkey))
        return [tuple(json.loads(raw[str(i)])) for i in range(len(raw))]

    def replace_target(self, vkey: str, shard: int, replica: int, old: str, new: str) -> bool:
        """The plan of a pending version's shard names `new` for `replica` instead of `old` (a
        node lost mid-store, replaced): re-sends and repairs then aim at the node that holds
        the copy. A no-op (False) once the plan names another node there or the version left
        pending."""
        return bool(
            self._replace_target(
                keys=[K.VERSION.format(vkey=vkey), K.PLAN.format(vkey=vkey)],
                args=[str(shard), replica + 1, old, new],
            )
        )

    def state(self, vkey: str) -> str | None:
        return self.r.hget(K.VERSION.format(vkey=vkey), "state")

    def abort(self, vkey: str, reason: str) -> bool:
        """pending -> aborted; True if this call aborted it (a committed version stays)."""
        aborted = bool(
            self._abort(keys=[K.VERSION.format(vkey=vkey), K.VERSION_STATES], args=[reason, vkey])
        )
        if aborted:  # no transfer of it runs now (a store of it again keeps them afresh)
            self.r.delete(K.SPANS.format(vkey=vkey))
        return aborted

    def claim(self, vkey: str, flag: str) -> bool:
        """Set a one-time flag on a version; True for the single caller that set it."""
        return bool(self.r.hsetnx(K.VERSION.format(vkey=vkey), flag, "1"))

    def record_attempt(self, vkey: str, entry: dict) -> None:
        """Append to the version's attempt log, keeping its last ATTEMPTS_KEPT entries."""
        key = K.ATTEMPTS.format(vkey=vkey)
        with self.r.pipeline() as p:
            p.rpush(key, json.dumps({**entry, "at": time.time()}))
            p.ltrim(key, -defaults.ATTEMPTS_KEPT, -1)
            p.execute()

    def attempts(self, vkey: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(K.ATTEMPTS.format(vkey=vkey), 0, -1)]

    def settle(
        self,
        vkey: str,
        shard: int,
        replica: int,
        node_id: str | None,
        digest: str,
        held: bool = False,
    ) -> bool:
        """Record a finished transfer (node_id None when it failed for good); True when the
        set is complete and no commit was enqueued yet: the caller enqueues the commit, then
        calls mark_commit_enqueued. `held`: the caller counted the node from the placement
        without sending. CopyBeingTrimmedError if the replica cannot count (see _BARRIER)."""
        v = self.r.hmget(K.VERSION.format(vkey=vkey), "transfers", "shards")
        done = self._barrier(
            keys=[
                K.SETTLED.format(vkey=vkey),
                K.READY.format(vkey=vkey),
                K.VERSION.format(vkey=vkey),
                K.PLACEMENT.format(digest=digest),
                K.TRIM_MARK.format(digest=digest, node_id=node_id or ""),
                K.PLACEMENTS_LISTED,
            ],
            args=[
                f"{shard}:{replica}",
                "" if node_id is None else str(shard),
                node_id or "",
                v[0] or 0,
                v[1] or 0,
                "1" if held else "",
                digest,
            ],
        )
        if done == -1:
            raise CopyBeingTrimmedError(
                f"the copy of {digest} on node {node_id} is being trimmed (or was, since it"
                " was counted): it is sent there again"
            )
        return bool(done)

    def mark_commit_enqueued(self, vkey: str) -> None:
        """Record that the commit is queued (only after it is: see _BARRIER)."""
        self.r.hset(K.VERSION.format(vkey=vkey), "commit_enqueued", repr(time.time()))

    def reopen_shards(self, vkey: str, shards: list[int]) -> bool:
        """Send the barrier back for `shards` of a pending version (their copies are gone)."""
        plan = self.plan(vkey)
        args = [x for i in shards for x in (i, len(plan[i]))]
        keys = [K.VERSION.format(vkey=vkey), K.SETTLED.format(vkey=vkey), K.READY.format(vkey=vkey)]
        return bool(self._reopen(keys=keys, args=args))

    def barrier_complete(self, vkey: str) -> bool:
        """Every transfer settled and every shard has a verified copy."""
        with self.r.pipeline() as p:
            p.hmget(K.VERSION.format(vkey=vkey), "transfers", "shards")
            p.scard(K.SETTLED.format(vkey=vkey))
            p.scard(K.READY.format(vkey=vkey))
            (transfers, shards), settled, ready = p.execute()
        return settled >= int(transfers or 0) and ready >= int(shards or 0)

    def snapshot(self, vkey: str) -> tuple[dict[str, str], set[str], set[int]]:
        """The version hash, its settled transfers and its ready shards in one consistent
        read (a MULTI block), so a transfer settling in between cannot split them."""
        with self.r.pipeline(transaction=True) as p:
            p.hgetall(K.VERSION.format(vkey=vkey))
            p.smembers(K.SETTLED.format(vkey=vkey))
            p.smembers(K.READY.format(vkey=vkey))
            v, settled, ready = p.execute()
        if not v:
            raise NotFoundError(f"no version {vkey} in the metadata; see `smoltorrent ls`.")
        return v, set(settled), {int(x) for x in ready}

    def progress(self, vkey: str) -> tuple[int, int]:
        """(transfers settled, transfers planned)."""
        return (
            self.r.scard(K.SETTLED.format(vkey=vkey)),
            int(self.r.hget(K.VERSION.format(vkey=vkey), "transfers") or 0),
        )

    def ready_shards(self, vkey: str) -> set[int]:
        return {int(x) for x in self.r.smembers(K.READY.format(vkey=vkey))}

    def record_sent(self, vkey: str, shard: int, replica: int, sent: int) -> None:
        """How far the running transfer of (shard, replica) has got, in bytes."""
        key = K.SENT.format(vkey=vkey)
        with self.r.pipeline() as p:
            p.hset(key, f"{shard}:{replica}", sent)
            p.expire(key, defaults.SENT_PROGRESS_TTL_S)
            p.execute()

    def sent(self, vkey: str) -> dict[str, int]:
        """ "shard:replica" -> bytes sent so far by transfers still running (or just done)."""
        return {k: int(v) for k, v in self.r.hgetall(K.SENT.format(vkey=vkey)).items()}

    def settled(self, vkey: str) -> set[str]:
        return set(self.r.smembers(K.SETTLED.format(vkey=vkey)))

    def commit(self, vkey: str, name: str) -> bool:
        """pending -> committed, and current unless a later request's version already is;
        True if it is current now. A version aborted or being removed stays as it is."""
        state, current = self._commit(
            keys=[K.VERSION.format(vkey=vkey), K.CURRENT, K.CURRENT_SEQ, K.VERSION_STATES],
            args=[name, vkey, time.time()],
        )
        if state == COMMITTED:  # its attempt log is history now: kept a while, then gone
            with self.r.pipeline(transaction=False) as p:
                p.expire(K.ATTEMPTS.format(vkey=vkey), defaults.ATTEMPTS_TTL_S)
                p.delete(K.SPANS.format(vkey=vkey))
                p.execute()
        return bool(current)

    def restore_committed(self, manifest: Manifest, vkey: str) -> bool:
        """Record a version read back from a node's manifest (rebuild); False if Redis
        knows it already, in any state (a removing or removed one is never brought back).
        Rebuild calls this oldest first, so sequence numbers keep their order."""
        if self.r.exists(K.VERSION.format(vkey=vkey)):
            return False
        state = self.create_pending(manifest, vkey, {"rebuilt": 1}, [])
        if state != "created":
            return False
        self.commit(vkey, manifest.name)
        return True

    def placement(self, digest: str) -> set[str]:
        return set(self.r.smembers(K.PLACEMENT.format(digest=digest)))

    def add_placement(self, digest: str, node_id: str) -> None:
        with self.r.pipeline() as p:  # MULTI: the listed copy goes with the change
            p.sadd(K.PLACEMENT.format(digest=digest), node_id)
            p.hdel(K.PLACEMENTS_LISTED, digest)
            p.execute()

    def remove_placement(self, digest: str, node_id: str) -> None:
        with self.r.pipeline() as p:
            p.srem(K.PLACEMENT.format(digest=digest), node_id)
            p.hdel(K.PLACEMENTS_LISTED, digest)
            p.execute()

    def names(self) -> list[str]:
        return sorted(self.r.smembers(K.NAMES))

    def versions(self, name: str) -> list[str]:
        return list(self.r.zrange(K.VERSIONS.format(name=name), 0, -1))

    def current(self, name: str) -> str | None:
        return self.r.hget(K.CURRENT, name)

    def versions_in(self, *states: str) -> list[tuple[str, dict[str, str]]]:
        """(vkey, version hash) of every listed version in one of `states`, in request order:
        the states of all come from one hash, and only the matching versions are read."""
        vkeys = self.vkeys_in(states)
        with self.r.pipeline(transaction=False) as p:
            for vkey in vkeys:
                p.hgetall(K.VERSION.format(vkey=vkey))
            hashes = p.execute()
        return [
            (vkey, v) for vkey, v in zip(vkeys, hashes, strict=True) if v.get("state") in states
        ]

    def version_states(self) -> dict[str, str]:
        """vkey -> state of every listed version, in one request."""
        self._fill_summaries()
        return self.r.hgetall(K.VERSION_STATES)

    def listed_states(self) -> tuple[list[str], dict[str, str]]:
        """Every listed vkey in request order, and vkey -> state: one round trip whatever
        their number (no version hash read)."""
        self._fill_summaries()
        with self.r.pipeline(transaction=False) as p:
            p.zrange(K.ALL_VERSIONS, 0, -1)
            p.hgetall(K.VERSION_STATES)
            vkeys, found = p.execute()
        return vkeys, found

    def vkeys_in(self, states: Iterable[str]) -> list[str]:
        """The vkeys of every listed version in one of `states`, in request order."""
        vkeys, found = self.listed_states()
        return [v for v in vkeys if found.get(v) in states]

    def has_name(self, name: str) -> bool:
        return bool(self.r.sismember(K.NAMES, name))

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
        (among `live` if given), or using one of those blobs. A few round trips and one reply
        per slice of LISTING_BATCH_VERSIONS, whatever the number of versions: no version hash
        or manifest is read."""
        self._fill_summaries()
        zset = K.ALL_VERSIONS if name is None else K.VERSIONS.format(name=name)
        count = self.r.zcard(zset)
        among = list(among)
        live = None if live is None else list(live)
        head, tail = K.PLACEMENT.split("{digest}")
        options = ("d" if digests else "") + ("" if notable is None else "n")
        nodes = [len(among), *among, *([-1] if live is None else [len(live), *live])]
        nodes.extend(notable or ())
        batch = defaults.LISTING_BATCH_VERSIONS
        starts = range(0, count, batch)
        # One MULTI block: the slices see one state (a remove between two would shift the
        # ranks), and the last runs to the end (versions added since the count).
        with self.r.pipeline(transaction=True) as p:
            for start in starts:
                stop = -1 if start == starts[-1] else start + batch - 1
                self._listing(
                    keys=[zset, K.VERSION_ROWS, K.VERSION_STATES, K.CURRENT, K.PLACEMENTS_LISTED],
                    args=[start, stop, K.VERSION.format(vkey=""), head, tail, options, *nodes],
                    client=p,
                )
            replies = p.execute() if count else []
        out = [row for reply in replies for row in json.loads(reply)]
        out.sort(key=lambda r: r["name"])  # stable: request order within a name
        return out

    def _fill_summaries(self) -> None:
        """Listing rows and states for the versions recorded before they existed: once per
        Redis (a marker key says it is done), each version in one atomic step."""
        if self.r.exists(K.SUMMARIES_FILLED):
            return
        listed = [(name, vkey) for name in self.names() for vkey in self.versions(name)]
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
                    row = _listing_row(Manifest.from_json(raw), int(transfers or 0))
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

    def last_activity(self, vkey: str, version: dict[str, str]) -> float:
        """Unix time of the version's last transfer attempt, re-send or creation."""
        last = self.r.lindex(K.ATTEMPTS.format(vkey=vkey), -1)
        return max(
            float(version.get("created_at") or 0),
            float(version.get("resent_at") or 0),
            json.loads(last)["at"] if last else 0.0,
        )

    def mark_resent(self, vkey: str) -> None:
        self.r.hset(K.VERSION.format(vkey=vkey), "resent_at", repr(time.time()))

    # --- workers -----------------------------------------------------------------

    def worker_alive(self, host: str, boot: str) -> None:
        """Refresh the TTL key saying this host's worker (started as `boot`) runs."""
        with self.r.pipeline() as p:
            p.set(K.WORKER_ALIVE.format(host=host), boot, ex=defaults.WORKER_ALIVE_TTL_S)
            p.sadd(K.WORKER_HOSTS, host)
            p.execute()

    def worker_gone(self, host: str, boot: str) -> None:
        """Drop the alive key of a worker shutting down cleanly (if it is still ours)."""
        key = K.WORKER_ALIVE.format(host=host)
        if self.r.get(key) == boot:
            self.r.delete(key)

    def worker_boot(self, host: str) -> str | None:
        """Boot id of the worker serving `host`, None if none was heard from lately."""
        return self.r.get(K.WORKER_ALIVE.format(host=host))

    def worker_boots(self) -> dict[str, str]:
        """Host -> boot id of every worker heard from lately (the hosts from their set, not
        a scan of the keyspace; a host whose alive key expired leaves the set)."""
        hosts = sorted(self.r.smembers(K.WORKER_HOSTS))
        boots = self.r.mget([K.WORKER_ALIVE.format(host=h) for h in hosts]) if hosts else []
        gone = [h for h, boot in zip(hosts, boots, strict=True) if boot is None]
        if gone:
            self.r.srem(K.WORKER_HOSTS, *gone)
        return {h: boot for h, boot in zip(hosts, boots, strict=True) if boot is not None}

    def pending_versions(self) -> list[str]:
        return self.vkeys_in((PENDING,))

    def resolve(self, name: str, version: str | None = None) -> str:
        """vkey of `name` at `version` (a version-id prefix), or its current version."""
        if version is None:
            vkey = self.current(name)
            if vkey is None:
                known = self.versions(name)
                raise NotFoundError(
                    f"{name} has no committed version"
                    + (
                        f" ({len(known)} pending or aborted; see `smoltorrent ls`)."
                        if known
                        else "; list stored checkpoints with `smoltorrent ls`."
                    )
                )
            return vkey
        vkeys = self.versions(name)
        with self.r.pipeline(transaction=False) as p:
            for v in vkeys:
                p.hget(K.VERSION.format(vkey=v), "version_id")
            ids = p.execute()
        matches = [v for v, i in zip(vkeys, ids, strict=True) if (i or "").startswith(version)]
        if len(matches) != 1:
            raise NotFoundError(
                f"{name} has {'no' if not matches else 'several'} versions matching "
                f"'{version}'; see `smoltorrent ls`."
            )
        return matches[0]

    def begin_remove(self, vkey: str) -> str | None:
        """pending | committed | aborted -> removing (another version becomes current if
        this one was); the state found, None if the version is unknown. A version already
        removing is resumed by the caller; one removed is done."""
        found = self._remove_keys(vkey)
        if found is None:
            return None
        name, keys, blob_keys, digests = found
        return self._remove_begin(
            keys=[*keys, *blob_keys],
            args=[name, vkey, time.time(), defaults.BLOB_TOMBSTONE_TTL_S, *digests],
        )

    def retire(self, vkey: str, keep: int) -> str:
        """Retention's remove: committed | aborted -> removing unless the version is
        current, read by a gather, or among the `keep` newest committed versions of its
        name (an aborted one: unless no committed version is newer). "retired" (the caller
        sends the remove), else why not: "current", "reading", "kept" or the state found."""
        found = self._remove_keys(vkey)
        if found is None:
            return "missing"
        name, keys, blob_keys, digests = found
        return self._retire(
            keys=[*keys, K.READERS.format(vkey=vkey), *blob_keys],
            args=[name, vkey, time.time(), defaults.BLOB_TOMBSTONE_TTL_S, keep, *digests],
        )

    def _remove_keys(self, vkey: str) -> tuple[str, list[str], list[str], list[str]] | None:
        """(name, the seven leading keys, blob key pairs, digests) of a remove script."""
        name = self.r.hget(K.VERSION.format(vkey=vkey), "name")
        if name is None:
            return None
        raw = self.r.get(K.MANIFEST.format(vkey=vkey))
        digests = _digests(Manifest.from_json(raw)) if raw else []
        blob_keys = []
        for d in digests:
            blob_keys += [K.BLOB_REFS.format(digest=d), K.BLOB_DELETING.format(digest=d)]
        keys = [
            K.VERSION.format(vkey=vkey),
            K.VERSIONS.format(name=name),
            K.CURRENT,
            K.CURRENT_SEQ,
            K.VERSION.format(vkey=""),
            K.REMOVE_BLOBS.format(vkey=vkey),
            K.VERSION_STATES,
        ]
        return name, keys, blob_keys, digests

    def start_reading(self, vkey: str, reader: str, ttl_s: float) -> str:
        """Set or refresh a gather's reader mark on a committed version for `ttl_s`; the
        state found (the mark is set only if it is "committed")."""
        return self._read(
            keys=[K.VERSION.format(vkey=vkey), K.READERS.format(vkey=vkey)],
            args=[reader, int(ttl_s * 1000)],
        )

    def stop_reading(self, vkey: str, reader: str) -> None:
        self.r.zrem(K.READERS.format(vkey=vkey), reader)

    def readers(self, vkey: str) -> list[str]:
        """Reader marks on a version not yet expired (by the Redis server's clock)."""
        seconds, micros = self.r.time()
        now_ms = seconds * 1000 + micros // 1000
        return list(self.r.zrangebyscore(K.READERS.format(vkey=vkey), f"({now_ms}", "+inf"))

    def blobs_to_delete(self, vkey: str) -> set[str]:
        """Blobs a removing version left unreferenced, not yet deleted from the nodes."""
        return set(self.r.smembers(K.REMOVE_BLOBS.format(vkey=vkey)))

    def blob_deleted(self, vkey: str, digest: str, nodes: Iterable[str]) -> None:
        """The remove of `vkey` deleted `digest` from every node in `nodes` that held it."""
        self._blob_deleted(
            keys=[
                K.PLACEMENT.format(digest=digest),
                K.BLOB_REFS.format(digest=digest),
                K.BLOB_DELETING.format(digest=digest),
                K.REMOVE_BLOBS.format(vkey=vkey),
                K.PLACEMENTS_LISTED,
            ],
            args=[digest, *nodes],
        )

    def blob_deleting(self, digest: str) -> bool:
        """Whether a remove is deleting this blob from the nodes right now."""
        return bool(self.r.exists(K.BLOB_DELETING.format(digest=digest)))

    def blob_refs(self, digest: str) -> set[str]:
        return set(self.r.smembers(K.BLOB_REFS.format(digest=digest)))

    def finish_remove(self, vkey: str) -> bool:
        """removing -> removed, deleting the version's keys: the last step of a remove,
        once no node holds its manifest or its unshared blobs."""
        name = self.r.hget(K.VERSION.format(vkey=vkey), "name")
        if name is None:
            return False
        finished = bool(
            self._remove_finish(
                keys=[
                    *self._version_keys(vkey),
                    K.VERSIONS.format(name=name),
                    K.NAMES,
                    K.REMOVE_BLOBS.format(vkey=vkey),
                    K.VERSION_ROWS,
                    K.VERSION_STATES,
                    K.ALL_VERSIONS,
                ],
                args=[name, vkey, time.time(), defaults.REMOVED_TOMBSTONE_TTL_S],
            )
        )
        if finished:
            # A pending version removed had its spans kept. They describe these very bytes:
            # a store of them starting meanwhile loses nothing (its transfers read the
            # manifest then).
            self.r.delete(K.SPANS.format(vkey=vkey))
        return finished

    # --- sweeps -------------------------------------------------------------------

    def redis_time(self) -> float:
        """Seconds on the Redis server's clock: one clock for every host."""
        seconds, micros = self.r.time()
        return seconds + micros / 1e6

    def sweep_ran(self, name: str, started: float, by: str, outcome: str) -> None:
        """Record one run of a sweep (its last SWEEP_RUNS_KEPT are kept)."""
        key = K.SWEEP_RUNS.format(name=name)
        run = {"started": started, "finished": self.redis_time(), "by": by, "outcome": outcome}
        with self.r.pipeline() as p:
            p.rpush(key, json.dumps(run))
            p.ltrim(key, -defaults.SWEEP_RUNS_KEPT, -1)
            p.execute()

    def sweep_runs(self, name: str) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange(K.SWEEP_RUNS.format(name=name), 0, -1)]

    def sweep_skipped(self, name: str) -> None:
        self.r.incr(K.SWEEP_SKIPPED.format(name=name))

    def sweep_skips(self, name: str) -> int:
        return int(self.r.get(K.SWEEP_SKIPPED.format(name=name)) or 0)

    # --- crosscheck -------------------------------------------------------------

    def placements(self) -> dict[str, set[str]]:
        """Every blob's placement: digest -> node ids holding a verified copy."""
        head, tail = K.PLACEMENT.split("{digest}")
        keys = list(self.r.scan_iter(match=K.PLACEMENT.format(digest="*"), count=1000))
        with self.r.pipeline(transaction=False) as p:
            for key in keys:
                p.smembers(key)
            members = p.execute()
        return {
            k[len(head) : len(k) - len(tail)]: set(m) for k, m in zip(keys, members, strict=True)
        }

    def referenced(self, digests: list[str]) -> dict[str, bool]:
        """digest -> whether any version (not removing or removed) uses it."""
        with self.r.pipeline(transaction=False) as p:
            for d in digests:
                p.scard(K.BLOB_REFS.format(digest=d))
            counts = p.execute()
        return {d: n > 0 for d, n in zip(digests, counts, strict=True)}

    def record_copy(self, digest: str, node_id: str) -> bool:
        """Add a copy a node holds to the placement if a version uses the blob; True if it
        was not listed before."""
        keys = [
            K.PLACEMENT.format(digest=digest),
            K.BLOB_REFS.format(digest=digest),
            K.PLACEMENTS_LISTED,
        ]
        return bool(self._record_copy(keys=keys, args=[node_id, digest]))

    def note_orphan(self, digest: str, node_id: str) -> float:
        """Record (once) that `node_id` holds `digest` with no version using it; seconds
        since it was first found so, by the Redis clock."""
        now = self.r.time()[0]
        field = f"{digest}:{node_id}"
        self.r.hsetnx(K.ORPHANS, field, now)
        return now - float(self.r.hget(K.ORPHANS, field) or now)

    def orphan_marks(self) -> set[str]:
        return set(self.r.hkeys(K.ORPHANS))

    def forget_orphans(self, fields: Iterable[str]) -> None:
        fields = list(fields)
        if fields:
            self.r.hdel(K.ORPHANS, *fields)

    def claim_orphan(self, digest: str, owner: str) -> bool:
        """Tombstone an unreferenced blob before deleting it from nodes; False if a version
        uses it or a remove is deleting it."""
        keys = [K.BLOB_REFS.format(digest=digest), K.BLOB_DELETING.format(digest=digest)]
        return bool(self._claim_orphan(keys=keys, args=[owner, defaults.BLOB_TOMBSTONE_TTL_S]))

    def orphan_deleted(self, digest: str, owner: str, nodes: Iterable[str]) -> None:
        """The crosscheck `owner` deleted orphan `digest` from `nodes` (maybe none): drop
        their placement and orphan marks, and its tombstone."""
        self._orphan_deleted(
            keys=[
                K.PLACEMENT.format(digest=digest),
                K.BLOB_REFS.format(digest=digest),
                K.BLOB_DELETING.format(digest=digest),
                K.ORPHANS,
                K.PLACEMENTS_LISTED,
            ],
            args=[owner, digest, *nodes],
        )

    def record_bad_copy(self, digest: str, node_id: str, reason: str) -> None:
        """Note a copy that served wrong bytes, for the integrity sweep to repair."""
        self.r.hset(
            K.BAD_COPIES, f"{digest}:{node_id}", json.dumps({"reason": reason, "at": time.time()})
        )

    def reported_bad_copies(self) -> list[tuple[str, str]]:
        """(digest, node id) of every copy a reader found corrupt, not yet checked."""
        return [tuple(f.split(":", 1)) for f in self.r.hkeys(K.BAD_COPIES)]

    def forget_bad_copy(self, digest: str, node_id: str) -> None:
        self.r.hdel(K.BAD_COPIES, f"{digest}:{node_id}")

    # --- requests (intents) -----------------------------------------------------

    def open_request(self, rid: str, kind: str, host: str, args: dict) -> int:
        """Record a request before its task is queued; its sequence number."""
        return int(
            self._open_request(
                keys=[K.SEQ, K.REQUEST.format(rid=rid), K.REQUESTS_OPEN],
                args=[kind, host, json.dumps(args), time.time(), rid],
            )
        )

    def request(self, rid: str) -> dict[str, str]:
        data = self.r.hgetall(K.REQUEST.format(rid=rid))
        if not data:
            raise NotFoundError(f"no request {rid} in the metadata.")
        return data

    def start_request(self, rid: str, boot: str) -> str:
        """Mark a request running by the worker started as `boot`; the state found
        ("done" means an earlier run finished it: do not run it again)."""
        return self._start_request(keys=[K.REQUEST.format(rid=rid)], args=[boot, time.time()])

    def finish_request(self, rid: str, state: str, **fields) -> None:
        """Close a request as done or failed, with what its caller needs to know; it stays
        readable for REQUEST_TTL_S."""
        with self.r.pipeline() as p:
            p.hset(
                K.REQUEST.format(rid=rid),
                mapping={"state": state, "finished_at": time.time(), **fields},
            )
            p.expire(K.REQUEST.format(rid=rid), defaults.REQUEST_TTL_S)
            p.zrem(K.REQUESTS_OPEN, rid)
            p.execute()

    def open_requests(self) -> list[tuple[str, dict[str, str]]]:
        """(request id, record) of every request not yet done or failed, oldest first."""
        rids = self.r.zrange(K.REQUESTS_OPEN, 0, -1)
        with self.r.pipeline(transaction=False) as p:
            for rid in rids:
                p.hgetall(K.REQUEST.format(rid=rid))
            records = p.execute()
        return [(rid, rec) for rid, rec in zip(rids, records, strict=True) if rec]

    # --- dead letters ----------------------------------------------------------

    def add_dead_letter(self, task_id: str, record: dict) -> None:
        vkey = (record.get("kwargs") or {}).get("vkey") or _vkey_of_task(task_id)
        with self.r.pipeline() as p:
            p.hset(K.DLQ, task_id, json.dumps({**record, "task_id": task_id, "at": time.time()}))
            p.xadd(K.DLQ_STREAM, {"task_id": task_id}, maxlen=defaults.DLQ_STREAM_MAXLEN)
            if vkey:
                p.sadd(K.DLQ_OF.format(vkey=vkey), task_id)
            p.execute()

    def dead_letters(self) -> list[dict]:
        records = [json.loads(v) for v in self.r.hgetall(K.DLQ).values()]
        return sorted(records, key=lambda r: r["at"])

    def dead_letter(self, task_id: str) -> dict:
        raw = self.r.hget(K.DLQ, task_id)
        if raw is None:
            raise NotFoundError(f"no dead letter {task_id}; list them with `smoltorrent dlq ls`.")
        return json.loads(raw)

    def has_dead_letter(self, task_id: str) -> bool:
        return bool(self.r.hexists(K.DLQ, task_id))

    def remove_dead_letter(self, task_id: str) -> None:
        raw = self.r.hget(K.DLQ, task_id)
        vkey = _vkey_of_task(task_id)
        if raw is not None:
            vkey = (json.loads(raw).get("kwargs") or {}).get("vkey") or vkey
        with self.r.pipeline() as p:
            p.hdel(K.DLQ, task_id)
            if vkey:
                p.srem(K.DLQ_OF.format(vkey=vkey), task_id)
            p.execute()

    def drop_dead_letters_of(self, vkey: str) -> int:
        """Forget the dead letters of a removed version (nothing left to replay them for):
        those its index lists, without reading the rest of the queue."""
        key = K.DLQ_OF.format(vkey=vkey)
        ids = list(self.r.smembers(key))
        dropped = self.r.hdel(K.DLQ, *ids) if ids else 0
        self.r.delete(key)
        return dropped

    def dead_letter_depth(self) -> int:
        return self.r.hlen(K.DLQ)
