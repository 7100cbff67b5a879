--[[
  Retention's remove: committed -> removing only if no gather holds an unexpired reader
  mark on the version, it is not pinned, and
  - by the last K of its name (keep >= 0): it is not current and at least `keep` newer
    committed versions of its name exist (an aborted one: once a newer committed version
    exists);
  - by prefix (keep = -1): every version of its name was last requested before `before`
    (the latest request of the oldest entry kept under the prefix); a current version goes
    too, the latest requested other committed version of the name becoming current.
  Checked and done in one step, so a gather taking its mark, a pin, or a store making the
  version (or its name) current again either happens before (and the version stays) or
  finds it removing. What it removes, as removals/begin.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] VERSIONS: the versions of its name
    KEYS[3] CURRENT: name -> current vkey
    KEYS[4] CURRENT_SEQ: name -> sequence number that made it current
    KEYS[5] REMOVE_BLOBS: the blobs this remove deletes
    KEYS[6] VERSION_STATES: listing states
    KEYS[7] READERS: its reader marks
    KEYS[8] PINS: pinned versions
    KEYS[9..] (BLOB_REFS, BLOB_DELETING)*, VERSION*: per blob its reference set and its
      tombstone; then the hash of each version of the name requested after it (by
      prefix: of every other version of the name)
    ARGV[1] name: the checkpoint name
    ARGV[2] vkey: the version key
    ARGV[3] now: unix time (s)
    ARGV[4] ttl: tombstone ttl (s)
    ARGV[5] keep: committed versions kept, or -1 for retention by prefix
    ARGV[6] before: by prefix, the sequence number every request of the name precedes
    ARGV[7] blobs: number of blobs (key pairs)
    ARGV[8..] digest*, vkey*: each blob's digest; then the vkey of each version hash passed

  Output:
    "retired" (the caller sends the remove), else why not: "current", "reading",
    "pinned", "kept" or the state found; "stale" if a version it must look at has no hash
    passed (nothing changed: the caller reads the versions again and retries)
]]
--- @include "begin_remove"
--- @include "now_ms"
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'committed' and state ~= 'aborted' then return state or 'missing' end
local keep = tonumber(ARGV[5])
if keep >= 0 and redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then return 'current' end
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now_ms())
if redis.call('ZCARD', KEYS[7]) > 0 then return 'reading' end
if redis.call('HEXISTS', KEYS[8], ARGV[2]) == 1 then return 'pinned' end
local nb = tonumber(ARGV[7])
local hash_of = hashes(9 + 2 * nb, 8 + nb)
if keep < 0 then
  local latest = redis.call('ZREVRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if latest[2] and tonumber(latest[2]) >= tonumber(ARGV[6]) then return 'kept' end
  local current, nxt = successor(hash_of)
  if current == 'stale' then return 'stale' end
  begin_remove(9, nb, 8, current, nxt, hash_of)
  return 'retired'
end
local newer = 0
for _, v in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, -1)) do
  if v == ARGV[2] then break end
  if not hash_of[v] then return 'stale' end
  if redis.call('HGET', hash_of[v], 'state') == 'committed' then newer = newer + 1 end
end
if state == 'committed' and newer < keep then return 'kept' end
if state == 'aborted' and newer == 0 then return 'kept' end
begin_remove(9, nb, 8, false, nil, hash_of)
return 'retired'
