--[[
  A blob a remove deleted from some nodes: they leave its placement; with no version using
  it any more, its placement goes entirely (Redis stays bounded). The tombstone goes last,
  so a store waiting on it then sends the blob afresh.

  Input:
    KEYS[1] PLACEMENT: the blob's placement
    KEYS[2] BLOB_REFS: its reference set
    KEYS[3] BLOB_DELETING: its tombstone
    KEYS[4] REMOVE_BLOBS: the remove's blobs to delete
    KEYS[5] PLACEMENTS_LISTED: the listing's copy of placements
    ARGV[1] digest: the blob's digest
    ARGV[2..] node*: the node ids it was deleted from

  Output:
    1
]]
for i = 2, #ARGV do redis.call('SREM', KEYS[1], ARGV[i]) end
redis.call('HDEL', KEYS[5], ARGV[1])
if redis.call('SCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[1]) end
redis.call('DEL', KEYS[3])
redis.call('SREM', KEYS[4], ARGV[1])
return 1
