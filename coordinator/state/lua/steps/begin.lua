--[[
  Opens a step of a per-rank sharded checkpoint, or joins it while it is pending with the
  same world size.

  Input:
    KEYS[1] STEP: the step hash
    KEYS[2] STEPS: the checkpoint's steps
    ARGV[1] step: the step number
    ARGV[2] world_size: number of ranks
    ARGV[3] now: unix time (s)

  Output:
    {"ok"} | {"world_size", theirs} | {"state", state}
]]
local ws = redis.call('HGET', KEYS[1], 'world_size')
if ws and ws ~= ARGV[2] then return {'world_size', ws} end
local state = redis.call('HGET', KEYS[1], 'state')
if state and state ~= 'pending' then return {'state', state} end
if not ws then
  redis.call('HSET', KEYS[1], 'world_size', ARGV[2], 'state', 'pending', 'parts', 0,
             'created_at', ARGV[3])
  redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
end
return {'ok'}
