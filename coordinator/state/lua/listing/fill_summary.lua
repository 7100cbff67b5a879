--[[
  A version recorded before the listing summaries existed gets its row, state and place in
  the all-versions zset, unless it left the listing meanwhile (the same step, so a state
  change cannot interleave).

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] VERSIONS: the versions of its name
    KEYS[3] VERSION_ROWS: listing rows
    KEYS[4] VERSION_STATES: listing states
    KEYS[5] ALL_VERSIONS: every listed version
    ARGV[1] vkey: the version key
    ARGV[2] row: the listing row JSON

  Output:
    1 if filled, else 0
]]
local state = redis.call('HGET', KEYS[1], 'state')
local seq = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not state or state == 'removed' or not seq then return 0 end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], state)
redis.call('ZADD', KEYS[5], seq, ARGV[1])
return 1
