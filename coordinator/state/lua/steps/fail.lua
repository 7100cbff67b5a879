--[[
  A rank's part of a pending step failed for good (its store ended badly, or its snapshot
  was lost): recorded, so that the other ranks stop waiting for it and a load says the
  step was abandoned rather than in flight. A new begin of the rank clears it.

  Input:
    KEYS[1] STEP: the step hash
    ARGV[1] rank: the rank
    ARGV[2] failure: {"at": unix time (s), "error": text}, JSON

  Output:
    1 if recorded, 0 if the step is gone or no longer pending
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'failed:' .. ARGV[1], ARGV[2])
return 1
