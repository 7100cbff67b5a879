--[[
  A remove asked for (rm): pending | committed | aborted -> removing. The version leaves
  the reference set of each of its blobs; a blob no version uses any more gets a tombstone
  (a store that needs it meanwhile waits, then sends it again) and goes on the list the
  remove deletes. If it was the name's current version, the latest requested other
  committed version becomes current. Nothing leaves removing except to removed.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] VERSIONS: the versions of its name
    KEYS[3] CURRENT: name -> current vkey
    KEYS[4] CURRENT_SEQ: name -> sequence number that made it current
    KEYS[5] REMOVE_BLOBS: the blobs this remove deletes
    KEYS[6] VERSION_STATES: listing states
    KEYS[7..] (BLOB_REFS, BLOB_DELETING)*, VERSION*: per blob its reference set and its
      tombstone; then the hash of each other version of the name it may make current
    ARGV[1] name: the checkpoint name
    ARGV[2] vkey: the version key
    ARGV[3] now: unix time (s)
    ARGV[4] ttl: tombstone ttl (s)
    ARGV[5] blobs: number of blobs (key pairs)
    ARGV[6..] digest*, vkey*: each blob's digest; then the vkey of each version hash passed

  Output:
    the state found ("pending", "committed", "aborted": removing now; "removing",
    "removed" or "missing": nothing changed); "stale" if the current version must change
    and a version the caller did not pass a hash for is among the candidates (nothing
    changed: the caller reads the versions again and retries)
]]
--- @include "begin_remove"
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'pending' and state ~= 'committed' and state ~= 'aborted' then
  return state or 'missing'
end
local nb = tonumber(ARGV[5])
local hash_of = hashes(7 + 2 * nb, 6 + nb)
local current, nxt = successor(hash_of)
if current == 'stale' then return 'stale' end
begin_remove(7, nb, 6, current, nxt, hash_of)
return state
