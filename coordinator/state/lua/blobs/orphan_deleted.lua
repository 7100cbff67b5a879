--[[
  An orphan the crosscheck deleted from some nodes: they leave its placement (all of it,
  if still no version uses it), its orphan marks go, and its tombstone, if this crosscheck
  set it.

  Input:
    KEYS[1] PLACEMENT: the blob's placement
    KEYS[2] BLOB_REFS: its reference set
    KEYS[3] BLOB_DELETING: its tombstone
    KEYS[4] ORPHANS: "digest:node" -> when first found
    KEYS[5] PLACEMENTS_LISTED: the listing's copy of placements
    ARGV[1] owner: the crosscheck run that claimed it
    ARGV[2] digest: the blob's digest
    ARGV[3..] node*: the node ids it was deleted from

  Output:
    1
]]
redis.call('HDEL', KEYS[5], ARGV[2])
for i = 3, #ARGV do
  redis.call('SREM', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[2] .. ':' .. ARGV[i])
end
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[1]) end
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
return 1
