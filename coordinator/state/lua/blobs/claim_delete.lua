--[[
  A remove about to delete a blob from the nodes looks again, in one step, whether a
  version uses it: one that does (the same bytes stored again once the tombstone had
  lapsed) takes the blob off the remove's list, and its copies stay. Otherwise the
  tombstone is set again for its full ttl, so however long a remove stays unfinished (a
  holder down, the remove sent again every reconcile pass), a store that needs the blob
  meanwhile finds it being deleted and waits.

  Input:
    KEYS[1] BLOB_REFS: the blob's reference set
    KEYS[2] BLOB_DELETING: its tombstone
    KEYS[3] REMOVE_BLOBS: the remove's blobs to delete
    ARGV[1] digest: the blob's digest
    ARGV[2] vkey: the removing version
    ARGV[3] ttl: tombstone ttl (s)

  Output:
    1 if the remove may delete its copies now; 0 if a version uses it (off the list)
]]
if redis.call('SCARD', KEYS[1]) > 0 then
  redis.call('SREM', KEYS[3], ARGV[1])
  if redis.call('GET', KEYS[2]) == ARGV[2] then redis.call('DEL', KEYS[2]) end
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[3]))
return 1
