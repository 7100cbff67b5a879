--[[
  Records one rank's stored part; the step moves pending -> committed with the last one,
  in this same step, so it is complete for every reader at once or for none.

  Input:
    KEYS[1] STEP: the step hash
    ARGV[1] rank: the rank
    ARGV[2] world_size: number of ranks
    ARGV[3] part: the part's record, JSON
    ARGV[4] now: unix time (s)

  Output:
    {"committed" | "pending"} | {"world_size", theirs} | {"state", state}
]]
local ws = redis.call('HGET', KEYS[1], 'world_size')
if not ws then return {'state', 'missing'} end
if ws ~= ARGV[2] then return {'world_size', ws} end
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'pending' then return {'state', state} end
if redis.call('HSET', KEYS[1], 'rank:' .. ARGV[1], ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[1], 'parts', 1)
end
if tonumber(redis.call('HGET', KEYS[1], 'parts')) == tonumber(ws) then
  redis.call('HSET', KEYS[1], 'state', 'committed', 'committed_at', ARGV[4])
  return {'committed'}
end
return {'pending'}
