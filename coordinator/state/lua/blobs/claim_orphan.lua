--[[
  The crosscheck claims a blob no version uses before deleting it from a node: the same
  tombstone a remove sets, so a store that starts using the blob meanwhile waits, then
  sends it again; a blob with a reference or a tombstone already is not claimed.

  Input:
    KEYS[1] BLOB_REFS: the blob's reference set
    KEYS[2] BLOB_DELETING: its tombstone
    ARGV[1] owner: the crosscheck run claiming it
    ARGV[2] ttl: tombstone ttl (s)

  Output:
    1 if claimed, else 0
]]
if redis.call('SCARD', KEYS[1]) > 0 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'EX', tonumber(ARGV[2]))
return 1
