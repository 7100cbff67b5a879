--[[
  A rank's writer is still storing its part of a pending step: its heartbeat, so that a
  reader tells a part in flight from one whose writer died (its beat goes stale).

  Input:
    KEYS[1] STEP: the step hash
    ARGV[1] rank: the rank
    ARGV[2] now: unix time (s)

  Output:
    1 if recorded, 0 if the step is gone or no longer pending
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'beat:' .. ARGV[1], ARGV[2])
return 1
