--[[
  The commit barrier: records one settled transfer and says whether the set is complete.
  A transfer for a committed version still adds its replica (a replay restoring R) but
  changes no state; one for a removing, removed or unknown version records nothing. The
  caller enqueues the commit and only then marks commit_enqueued, so a crash in between
  leaves a complete barrier without the mark, which the reconcile sweep finds and commits.
  A replica on a copy a trim is deleting (its mark stands), or one the caller counted from
  the placement without sending (held) on a node no longer in it, is refused: the caller
  sends the blob there again (why every order is safe: coordinator/state/trim_marks.py).

  Input:
    KEYS[1] SETTLED: the version's settled transfers
    KEYS[2] READY: its ready shards
    KEYS[3] VERSION: the version hash
    KEYS[4] PLACEMENT: the blob's placement
    KEYS[5] TRIM_MARK: the trim mark of (blob, node)
    KEYS[6] PLACEMENTS_LISTED: the listing's copy of placements
    ARGV[1] transfer: "shard:replica"
    ARGV[2] shard: the shard index, "" when the transfer failed for good
    ARGV[3] node: node id
    ARGV[4] transfers: number of transfers planned
    ARGV[5] shards: number of shards
    ARGV[6] held: "1" if counted from the placement without sending
    ARGV[7] digest: the blob's digest

  Output:
    1 the set is complete and no commit was enqueued yet; 0 otherwise; -1 refused
]]
local state = redis.call('HGET', KEYS[3], 'state')
if state ~= 'pending' and state ~= 'committed' and state ~= 'aborted' then return 0 end
if ARGV[2] ~= '' and (redis.call('EXISTS', KEYS[5]) == 1
    or (ARGV[6] == '1' and redis.call('SISMEMBER', KEYS[4], ARGV[3]) == 0)) then
  return -1
end
if ARGV[2] ~= '' and redis.call('SADD', KEYS[4], ARGV[3]) == 1 then
  redis.call('HDEL', KEYS[6], ARGV[7])
end
if state ~= 'pending' then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
if ARGV[2] ~= '' then redis.call('SADD', KEYS[2], ARGV[2]) end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[4])
   and redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[5])
   and not redis.call('HGET', KEYS[3], 'commit_enqueued') then
  return 1
end
return 0
