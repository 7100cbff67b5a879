--[[
  Swaps one node of a pending version's shard plan for another, if it is still the old
  one (a node lost mid-store, replaced).

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] PLAN: its placement plan
    ARGV[1] shard: the shard index
    ARGV[2] replica: the replica, 1-based
    ARGV[3] old: node id the plan must name there
    ARGV[4] new: node id to name instead

  Output:
    1 if swapped; 0 if the version left pending or the plan names another node there
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then return 0 end
local nodes = cjson.decode(raw)
local at = tonumber(ARGV[2])
if nodes[at] ~= ARGV[3] then return 0 end
nodes[at] = ARGV[4]
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(nodes))
return 1
