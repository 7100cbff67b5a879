--[[
  A pending version's shards found with no copy at commit time go back to unsettled, so
  their transfers run again and the barrier fires again.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] SETTLED: its settled transfers
    KEYS[3] READY: its ready shards
    ARGV[1..] shard, replicas: per lost shard, its index and its number of replicas

  Output:
    1 if reopened, 0 if the version is not pending
]]
if redis.call('HGET', KEYS[1], 'state') ~= 'pending' then return 0 end
for i = 1, #ARGV, 2 do
  redis.call('SREM', KEYS[3], ARGV[i])
  for r = 0, tonumber(ARGV[i + 1]) - 1 do redis.call('SREM', KEYS[2], ARGV[i] .. ':' .. r) end
end
redis.call('HDEL', KEYS[1], 'commit_enqueued')
return 1
