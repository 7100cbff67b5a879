--[[
  The run holding a request keeps its lease: renewed while it runs, dropped (lease_ms 0)
  when it ends without finishing the request (a retry, an error), so the next delivery
  takes it at once.

  Input:
    KEYS[1] REQUEST: the request's record
    ARGV[1] owner: the run ("boot:pid")
    ARGV[2] lease_ms: from now; 0 drops it

  Output:
    1 if that run still held it, else 0 (done, or taken by another run)
]]
--- @include "now_ms"
if redis.call('HGET', KEYS[1], 'state') ~= 'running'
   or redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'lease_until', now_ms() + tonumber(ARGV[2]))
return 1
