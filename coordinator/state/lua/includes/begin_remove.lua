-- Shared by removals/begin and removals/retire, whose first six KEYS and four ARGV are:
--   KEYS[1] VERSION  KEYS[2] VERSIONS  KEYS[3] CURRENT  KEYS[4] CURRENT_SEQ
--   KEYS[5] REMOVE_BLOBS  KEYS[6] VERSION_STATES
--   ARGV[1] name  ARGV[2] vkey  ARGV[3] now  ARGV[4] tombstone ttl (s)

-- vkey -> the key of its version hash, for the hashes the caller passed: KEYS from k on,
-- their vkeys ARGV from a on (to the end).
local function hashes(k, a)
  local out = {}
  for i = a, #ARGV do out[ARGV[i]] = KEYS[k + i - a] end
  return out
end

-- Whether this version is its name's current one and, if so, the latest requested other
-- version that is committed (nil if none). "stale" if a version it must look at has no
-- hash key passed: nothing was changed, the caller reads the versions again and retries.
local function successor(hash_of)
  if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return false end
  for _, v in ipairs(redis.call('ZREVRANGE', KEYS[2], 0, -1)) do
    if v ~= ARGV[2] then
      if not hash_of[v] then return 'stale' end
      if redis.call('HGET', hash_of[v], 'state') == 'committed' then return true, v end
    end
  end
  return true
end

-- -> removing. The version leaves the reference set of each of its `nb` blobs (key pairs
-- from KEYS[b]: reference set, tombstone; digests from ARGV[a]); a blob no version uses
-- any more gets a tombstone (a store that needs it meanwhile waits, then sends it again)
-- and goes on the list the remove deletes. If it was current, `nxt` (from successor,
-- its hash in hash_of) becomes current, or none.
local function begin_remove(b, nb, a, current, nxt, hash_of)
  redis.call('HSET', KEYS[1], 'state', 'removing', 'removing_at', ARGV[3])
  redis.call('HSET', KEYS[6], ARGV[2], 'removing')
  for j = 0, nb - 1 do
    local i = b + 2 * j
    redis.call('SREM', KEYS[i], ARGV[2])
    if redis.call('SCARD', KEYS[i]) == 0 then
      redis.call('SET', KEYS[i + 1], ARGV[2], 'EX', tonumber(ARGV[4]))
      redis.call('SADD', KEYS[5], ARGV[a + j])
    end
  end
  if current then
    redis.call('HDEL', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
    if nxt then
      redis.call('HSET', KEYS[3], ARGV[1], nxt)
      redis.call('HSET', KEYS[4], ARGV[1], redis.call('HGET', hash_of[nxt], 'seq') or '0')
    end
  end
end
