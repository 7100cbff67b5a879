--[[
  pending -> aborted, with its reason. Nothing ever moves committed -> aborted.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] VERSION_STATES: listing states
    ARGV[1] reason: why it was aborted
    ARGV[2] vkey: the version key

  Output:
    1 if this call aborted it, else 0
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'aborted', 'reason', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], 'aborted')
return 1
