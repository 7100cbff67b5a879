--[[
  Forgets the chunks whose blob a remove deleted from the nodes: each raw digest is
  dropped only while it still names that blob, so a store that recorded the same raw
  bytes under a new blob meanwhile keeps its entry.

  Input:
    KEYS[1] CHUNKS: raw digest -> "blob size encoding"
    ARGV[1..] (raw, blob)*: each raw digest with the blob it named

  Output:
    how many entries were dropped
]]
local dropped = 0
for i = 1, #ARGV, 2 do
  local entry = redis.call('HGET', KEYS[1], ARGV[i])
  if entry and string.sub(entry, 1, #ARGV[i + 1]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i])
    dropped = dropped + 1
  end
end
return dropped
