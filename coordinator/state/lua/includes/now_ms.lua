-- The time on the Redis server in ms: reader marks are set and checked on one clock,
-- whatever the clocks of the hosts that gather.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
