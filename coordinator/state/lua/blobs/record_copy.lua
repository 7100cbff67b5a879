--[[
  A copy found on a node that placement does not list: recorded only if a version uses
  the blob (checked in the same step, so a remove emptying its references wins).

  Input:
    KEYS[1] PLACEMENT: the blob's placement
    KEYS[2] BLOB_REFS: its reference set
    KEYS[3] PLACEMENTS_LISTED: the listing's copy of placements
    ARGV[1] node: node id holding the copy
    ARGV[2] digest: the blob's digest

  Output:
    1 if added, else 0
]]
if redis.call('SCARD', KEYS[2]) == 0 then return 0 end
redis.call('HDEL', KEYS[3], ARGV[2])
return redis.call('SADD', KEYS[1], ARGV[1])
