--[[
  committed -> removing: no reader takes the step from here on.

  Input:
    KEYS[1] STEP: the step hash

  Output:
    1 if this call did it, else 0
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'committed' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'removing')
return 1
