--[[
  pending -> committed, then current if its request is the latest accepted one. A version
  committed already is only made current (if its request is the latest); any other state
  stays: nothing ever moves aborted, removing or removed -> committed.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] CURRENT: name -> current vkey
    KEYS[3] CURRENT_SEQ: name -> sequence number that made it current
    KEYS[4] VERSION_STATES: listing states
    ARGV[1] name: the checkpoint name
    ARGV[2] vkey: the version key
    ARGV[3] now: unix time (s)

  Output:
    {state after (or "missing"), 1 if current}
]]
--- @include "make_current"
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
