--[[
  Retention's remove: committed -> removing only if the version is not current, no gather
  holds an unexpired reader mark on it, and at least `keep` newer committed versions of
  its name exist; aborted -> removing once a newer committed version exists. Checked and
  done in one step, so a gather taking its mark or a store making the version current
  again either happens before (and the version stays) or finds it removing. What it
  removes, as removals/begin.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] VERSIONS: the versions of its name
    KEYS[3] CURRENT: name -> current vkey
    KEYS[4] CURRENT_SEQ: name -> sequence number that made it current
    KEYS[5] REMOVE_BLOBS: the blobs this remove deletes
    KEYS[6] VERSION_STATES: listing states
    KEYS[7] READERS: its reader marks
    KEYS[8..] (BLOB_REFS, BLOB_DELETING)*, VERSION*: per blob its reference set and its
      tombstone; then the hash of each version of the name requested after it
    ARGV[1] name: the checkpoint name
    ARGV[2] vkey: the version key
    ARGV[3] now: unix time (s)
    ARGV[4] ttl: tombstone ttl (s)
    ARGV[5] keep: committed versions kept
    ARGV[6] blobs: number of blobs (key pairs)
    ARGV[7..] digest*, vkey*: each blob's digest; then the vkey of each version hash passed

  Output:
    "retired" (the caller sends the remove), else why not: "current", "reading", "kept"
    or the state found; "stale" if a newer version has no hash passed (nothing changed:
    the caller reads the versions again and retries)
]]
--- @include "begin_remove"
--- @include "now_ms"
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'committed' and state ~= 'aborted' then return state or 'missing' end
if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then return 'current' end
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now_ms())
if redis.call('ZCARD', KEYS[7]) > 0 then return 'reading' end
local nb = tonumber(ARGV[6])
local hash_of = hashes(8 + 2 * nb, 7 + nb)
local newer = 0
for _, v in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, -1)) do
  if v == ARGV[2] then break end
  if not hash_of[v] then return 'stale' end
  if redis.call('HGET', hash_of[v], 'state') == 'committed' then newer = newer + 1 end
end
if state == 'committed' and newer < tonumber(ARGV[5]) then return 'kept' end
if state == 'aborted' and newer == 0 then return 'kept' end
begin_remove(8, nb, 7, false, nil, hash_of)
return 'retired'
