--[[
  Opens a step of a per-rank sharded checkpoint, or joins it while it is pending with the
  same world size.

  Input:
    KEYS[1] STEP: the step hash
    KEYS[2] STEPS: the checkpoint's steps
    ARGV[1] step: the step number
    ARGV[2] world_size: number of ranks
    ARGV[3] now: unix time (s)
    ARGV[4] rank: the rank beginning its part ('' for none): marks it begun and alive
          now and clears a failure it recorded (the part is tried again)

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
if ARGV[4] ~= '' then
  redis.call('HSET', KEYS[1], 'begun:' .. ARGV[4], ARGV[3], 'beat:' .. ARGV[4], ARGV[3])
  redis.call('HDEL', KEYS[1], 'failed:' .. ARGV[4])
end
return {'ok'}
