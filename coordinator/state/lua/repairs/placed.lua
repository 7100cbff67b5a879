--[[
  A repaired copy joins the placement, after its target verified it, only while some
  version still uses the blob and no remove is deleting it (one step, so a remove racing
  the repair cannot leave a copy of a removed blob in the placement).

  Input:
    KEYS[1] PLACEMENT: the blob's placement
    KEYS[2] BLOB_REFS: its reference set
    KEYS[3] BLOB_DELETING: its tombstone
    KEYS[4] PLACEMENTS_LISTED: the listing's copy of placements
    ARGV[1] node: node id of the new copy
    ARGV[2] digest: the blob's digest

  Output:
    1 if the copy now counts; 0 if the blob is unused or being deleted (the caller
    deletes the copy it made)
]]
if redis.call('SCARD', KEYS[2]) == 0 or redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[2])
return 1
