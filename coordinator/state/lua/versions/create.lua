--[[
  Records the version a store request asks for: a new pending version, or joins the
  existing one (the same bytes again), raising its sequence number to this request's; a
  committed version a later request asks for again becomes current (a rollback moves no
  bytes). A new version joins the reference set of each of its blobs in the same step.
  A version joined keeps the references its recorded manifest made: the caller's blobs
  may be others (the same content encoded otherwise: SMOLTORRENT_ENCODE, auto as the
  live nodes change, another zstd), and a reference to them no remove would take away.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] MANIFEST: its manifest
    KEYS[3] PLAN: its placement plan
    KEYS[4] SETTLED: its settled transfers
    KEYS[5] READY: its ready shards
    KEYS[6] ATTEMPTS: its attempt log
    KEYS[7] NAMES: every checkpoint name
    KEYS[8] VERSIONS: the versions of its name
    KEYS[9] CURRENT: name -> current vkey
    KEYS[10] CURRENT_SEQ: name -> sequence number that made it current
    KEYS[11] VERSION_ROWS: listing rows
    KEYS[12] VERSION_STATES: listing states
    KEYS[13] ALL_VERSIONS: every listed version
    KEYS[14] SUMMARIES_FILLED: marker that the listing holds every version
    KEYS[15] MANIFEST_STAGED: its manifest JSON, written in pieces by the caller
    KEYS[16..] (BLOB_REFS)*: the reference set of each of the caller's blobs (the first
      ARGV[7]; written only for a new version), then of each blob the version's recorded
      manifest names if the caller read it aborted: recorded anew over an aborted
      version, it leaves these (its new blobs may be others), or no remove ever would
    ARGV[1] seq: the request's sequence number
    ARGV[2] name: the checkpoint name
    ARGV[3] vkey: the version key
    ARGV[4] fields: JSON object of the version hash's fields
    ARGV[5] plan: JSON list of each shard's target list (as JSON text)
    ARGV[6] row: the listing row JSON
    ARGV[7] fresh: how many of KEYS[16..] are the caller's blobs' reference sets

  Output:
    "created" (the staged manifest is its manifest now), or the state of the version
    joined: "pending", "committed", "removing" (then nothing changed: the caller waits
    for the remove to finish); the staged manifest is gone either way. "unstaged": no
    staged manifest (it expired) and nothing changed; the caller stages it again.
]]
--- @include "make_current"
local seq = tonumber(ARGV[1])
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'removing' then
  redis.call('DEL', KEYS[15])
  return state
end
local joined = state == 'pending' or state == 'committed'
if not joined and redis.call('EXISTS', KEYS[15]) == 0 then return 'unstaged' end
if joined then
  redis.call('DEL', KEYS[15])
  if seq > tonumber(redis.call('HGET', KEYS[1], 'seq') or '0') then
    redis.call('HSET', KEYS[1], 'seq', seq)
    redis.call('ZADD', KEYS[8], seq, ARGV[3])
    redis.call('ZADD', KEYS[13], seq, ARGV[3])
  end
  if state == 'committed' then make_current(KEYS[9], KEYS[10], ARGV[2], ARGV[3], seq) end
  return state
end
local fresh = tonumber(ARGV[7])
if state == 'aborted' then
  for i = 16 + fresh, #KEYS do redis.call('SREM', KEYS[i], ARGV[3]) end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
for k, v in pairs(cjson.decode(ARGV[4])) do redis.call('HSET', KEYS[1], k, v) end
redis.call('HSET', KEYS[1], 'state', 'pending', 'seq', seq)
-- Whole, and only now: a manifest half staged is never a version's.
redis.call('RENAME', KEYS[15], KEYS[2])
redis.call('PERSIST', KEYS[2])
for i = 16, 15 + fresh do redis.call('SADD', KEYS[i], ARGV[3]) end
for i, t in ipairs(cjson.decode(ARGV[5])) do redis.call('HSET', KEYS[3], tostring(i - 1), t) end
-- No name yet: nothing recorded before the listing summaries, none to fill.
if redis.call('SCARD', KEYS[7]) == 0 then redis.call('SET', KEYS[14], 1) end
redis.call('SADD', KEYS[7], ARGV[2])
redis.call('ZADD', KEYS[8], seq, ARGV[3])
redis.call('HSET', KEYS[11], ARGV[3], ARGV[6])
redis.call('HSET', KEYS[12], ARGV[3], 'pending')
redis.call('ZADD', KEYS[13], seq, ARGV[3])
return 'created'
