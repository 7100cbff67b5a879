--[[
  Step M of a trim (coordinator/state/trim_marks.py): count again the copies the blob
  needs (the most any version using it asks for, pending ones included, and the sweep's
  R) against its holders on up nodes; only if this copy is still surplus, mark it
  (expiring) and take the node out of the placement.

  Input:
    KEYS[1] PLACEMENT: the blob's placement
    KEYS[2] BLOB_REFS: its reference set
    KEYS[3] TRIM_MARK: the trim mark of (blob, node)
    KEYS[4] PLACEMENTS_LISTED: the listing's copy of placements
    KEYS[5..] (VERSION, MANIFEST)*: per version using the blob, its hash and its manifest
    ARGV[1] node: node id of the copy
    ARGV[2] keep: copies the sweep keeps
    ARGV[3] ttl: mark ttl (s)
    ARGV[4] digest: the blob's digest
    ARGV[5] up: number of up nodes
    ARGV[6..] node*, vkey*: the up nodes' ids; then the vkey of each version passed

  Output:
    1 marked and out of the placement; 0 no longer surplus (keep it); -1 the node no
    longer holds it; -2 a version using the blob has no keys passed (nothing changed: the
    caller reads its references again and retries)
]]
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 0 then return -1 end
local up = {}
local nup = tonumber(ARGV[5])
for i = 6, 5 + nup do up[ARGV[i]] = true end
local at = {}  -- vkey -> index of its version hash in KEYS
for i = 6 + nup, #ARGV do at[ARGV[i]] = 5 + 2 * (i - 6 - nup) end
local held = 0
for _, n in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if up[n] then held = held + 1 end
end
local keep = tonumber(ARGV[2])
for _, vkey in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local k = at[vkey]
  if not k then return -2 end
  local want = redis.call('HGET', KEYS[k], 'replicas')
  if not want then
    local raw = redis.call('GET', KEYS[k + 1])
    if raw then want = cjson.decode(raw)['replicas'] end
  end
  if want and tonumber(want) > keep then keep = tonumber(want) end
end
if held - 1 < keep then return 0 end
redis.call('SET', KEYS[3], '1', 'EX', ARGV[3])
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[4])
return 1
