--[[
  removing -> removed: the last step of a remove, once the nodes are clean. The version's
  keys go; a small tombstone stays (the version hash with name, state, removed_at, until
  it expires) so late transfers and commits see "removed".

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] MANIFEST: its manifest
    KEYS[3] PLAN: its placement plan
    KEYS[4] SETTLED: its settled transfers
    KEYS[5] READY: its ready shards
    KEYS[6] ATTEMPTS: its attempt log
    KEYS[7] VERSIONS: the versions of its name
    KEYS[8] NAMES: every checkpoint name
    KEYS[9] REMOVE_BLOBS: the blobs its remove deleted
    KEYS[10] VERSION_ROWS: listing rows
    KEYS[11] VERSION_STATES: listing states
    KEYS[12] ALL_VERSIONS: every listed version
    KEYS[13] MANIFEST_NODES: the nodes sent a copy of its manifest
    ARGV[1] name: the checkpoint name
    ARGV[2] vkey: the version key
    ARGV[3] now: unix time (s)
    ARGV[4] ttl: removed tombstone ttl (s)

  Output:
    1 if this call finished it, 0 if the version is not removing
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'removing' then return 0 end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[9], KEYS[13])
redis.call('HDEL', KEYS[10], ARGV[2])
redis.call('HDEL', KEYS[11], ARGV[2])
redis.call('ZREM', KEYS[12], ARGV[2])
redis.call('HSET', KEYS[1], 'name', ARGV[1], 'state', 'removed', 'removed_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
redis.call('ZREM', KEYS[7], ARGV[2])
if redis.call('ZCARD', KEYS[7]) == 0 then redis.call('SREM', KEYS[8], ARGV[1]) end
return 1
