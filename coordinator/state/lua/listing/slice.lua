--[[
  One slice of a listing, as the text of a JSON list (one reply parses far faster than
  thousands of small ones): the versions of the zset after the cursor (score, then vkey:
  the zset's own order), at most `limit` of them and no more than `budget` blob digests
  (the first version is taken whatever its count), so no one call holds Redis for long
  whatever the number of versions (a slice of 1,000 versions of 100 chunks held it for
  ~75 ms). For each that has a listing row (only the notable ones if options has "n":
  pending, committed with a shard under its replicas, or using one of the notable blobs),
  that row (with its digests only if options has "d") with "vkey", "state", "current",
  "transfers_settled" (not counted for a committed version, whose barrier fired: all of
  them), "reason" (aborted only), "copies" (per shard, how many of the nodes `among` its
  placement lists), "min_copies", "under_replicated" (shards with fewer copies than its
  replicas) and "live" (copies per shard among the nodes `live`, if given) added: the row
  `ls` shows, built here so the client only parses it. Placements are read from their
  listed copies (PLACEMENTS_LISTED) in one request per slice, a missing one from its set
  (then kept there): one request per blob made up most of a listing's time.

  Input:
    KEYS[1] ALL_VERSIONS|VERSIONS: the versions listed, in order
    KEYS[2] VERSION_ROWS: listing rows
    KEYS[3] VERSION_STATES: listing states
    KEYS[4] CURRENT: name -> current vkey
    KEYS[5] PLACEMENTS_LISTED: the listing's copy of placements
    KEYS[6..] (VERSION, SETTLED)*, PLACEMENT*: the hash and the settled transfers of each
      version passed; then the placement of each blob passed
    ARGV[1] score: the cursor's score ("-inf": from the first version)
    ARGV[2] after: the cursor's vkey (the last one listed; "" none)
    ARGV[3] limit: versions at most
    ARGV[4] budget: blob digests at most (the first version's taken whatever their count)
    ARGV[5] options: "d" digests, "n" notable only
    ARGV[6..] among, node*, live, node*, notable, digest*, versions, vkey*, digest*: the
      number of nodes among and their ids; the number of live nodes (-1: not asked) and
      their ids; the number of notable blobs and their digests; the number of versions
      passed and their vkeys; then the digest of each placement passed

  Output:
    {rows, score, vkey, more}: the JSON list of rows, the cursor after this slice (the
    last version read), and "1" if versions may follow it ("0": the zset's end); or, if a
    version not committed has no hash passed or a blob without a listed placement has no
    placement passed, {"v": "vkey ...", "d": "digest ..."} naming them (nothing read for
    the rows: the caller passes them and runs the same slice again)
]]
local with_digests = string.find(ARGV[5], 'd', 1, true) ~= nil
local notable_only = string.find(ARGV[5], 'n', 1, true) ~= nil
local among, live, wanted = {}, nil, {}
local pos = 6
local function take(into)  -- a count, then that many ARGV, into a set (-1: none, nil)
  local n = tonumber(ARGV[pos])
  pos = pos + 1
  if n < 0 then return nil end
  for i = pos, pos + n - 1 do into[ARGV[i]] = true end
  pos = pos + n
  return into
end
take(among)
live = take({})
take(wanted)
local hash_of, placement_of = {}, {}  -- vkey -> KEYS index of its hash; digest -> key
local nv = tonumber(ARGV[pos])
for i = 1, nv do hash_of[ARGV[pos + i]] = 4 + 2 * i end
for i = pos + nv + 1, #ARGV do placement_of[ARGV[i]] = KEYS[5 + 2 * nv + i - pos - nv] end
local function many(key, fields)  -- HMGET in chunks (Lua's unpack has a limit)
  local out = {}
  for i = 1, #fields, 1000 do
    local got = redis.call('HMGET', key, unpack(fields, i, math.min(i + 999, #fields)))
    for j = 1, #got do out[i + j - 1] = got[j] end
  end
  return out
end
-- The versions after the cursor: those of its score not yet listed (members of one score
-- sort by vkey), then the next scores; a page at a time while ties at the cursor fill it.
local limit, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local after, after_score = ARGV[2], tonumber(ARGV[1])
local vkeys, scores, offset, more = {}, {}, 0, false
while true do
  local got = redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'WITHSCORES', 'LIMIT',
    offset, limit)
  for i = 1, #got, 2 do
    if #vkeys < limit and not (tonumber(got[i + 1]) == after_score and got[i] <= after) then
      vkeys[#vkeys + 1], scores[#scores + 1] = got[i], got[i + 1]
    end
  end
  more = #got == 2 * limit
  if #vkeys == limit or not more then break end
  offset = offset + limit
end
more = more or #vkeys == limit  -- a page read only in part: versions may follow
if #vkeys == 0 then return {'[]', ARGV[1], after, '0'} end
-- Rows read a page at a time as the budget allows: a row of 100 chunks is 6.5 KB, and
-- reading all `limit` of them for the ~50 the budget takes cost more than the slice.
local ROWS_AT_ONCE = 32
local raws, states, read = {}, {}, 0
local function row_of(k)
  if k > read then
    local page = {unpack(vkeys, read + 1, math.min(read + ROWS_AT_ONCE, #vkeys))}
    local r, st = redis.call('HMGET', KEYS[2], unpack(page)), redis.call('HMGET', KEYS[3], unpack(page))
    for j = 1, #page do raws[read + j], states[read + j] = r[j], st[j] end
    read = read + #page
  end
  return raws[k], states[k]
end
local rows, blobs, seen, need_v, need_d = {}, {}, {}, {}, {}
local taken, digests = 0, 0  -- versions read in this slice, and their digests
for k, vkey in ipairs(vkeys) do
  local raw, state = row_of(k)
  if raw and state then
    -- The row is written by listing_row (listing.py): name first, digests last, each
    -- digest 64 hex digits in quotes. Plain finds, then matches anchored there: far
    -- cheaper than decoding it, or than a pattern tried at every byte (a quote inside a
    -- name is escaped, so cannot match).
    local at = string.find(raw, ',"digests":[', 1, true)
    local count = math.floor((#raw - at - 12) / 67)
    if taken > 0 and digests + count > budget then more = true; break end
    digests = digests + count
    local row = {raw = raw, state = state, vkey = vkey, digests = {}}
    row.name = string.match(raw, '^{"name":(".-"),"version_id":')
    at = string.find(raw, ',"replicas":', 1, true)
    row.replicas = tonumber(string.match(raw, '^%d+', at + 12))
    at = string.find(raw, ',"transfers":', at, true)
    row.settled = string.match(raw, '^%d+', at + 13)
    row.at = string.find(raw, ',"digests":[', at, true)
    for i = row.at + 13, #raw - 2, 67 do
      local d = string.sub(raw, i, i + 63)
      row.digests[#row.digests + 1] = d
      if not seen[d] then seen[d] = true; blobs[#blobs + 1] = d end
    end
    if state ~= 'committed' and not hash_of[vkey] then need_v[#need_v + 1] = vkey end
    rows[#rows + 1] = row
  end
  taken = k
end
local holders = {}  -- digest -> its placement, node ids space-separated
local listed = many(KEYS[5], blobs)
for i, d in ipairs(blobs) do
  local h = listed[i]
  if not h then
    if placement_of[d] then
      h = table.concat(redis.call('SMEMBERS', placement_of[d]), ' ')
      if h ~= '' then redis.call('HSET', KEYS[5], d, h) end
    else
      need_d[#need_d + 1] = d
    end
  end
  holders[d] = h
end
if #need_v > 0 or #need_d > 0 then
  return '{"v":"' .. table.concat(need_v, ' ') .. '","d":"' .. table.concat(need_d, ' ') .. '"}'
end
-- Copies per shard among `nodes`; a placement's count is worked out once per distinct
-- placement (a handful of node sets hold every blob).
local function counter(nodes)
  local memo = {}
  return function(digests)
    local out = {}
    for i, d in ipairs(digests) do
      local h = holders[d]
      local c = memo[h]
      if c == nil then
        c = 0
        for node in string.gmatch(h, '%S+') do
          if nodes[node] then c = c + 1 end
        end
        memo[h] = c
      end
      out[i] = c
    end
    return out
  end
end
local copies_among, copies_live = counter(among), live and counter(live)
-- Whether a row is shown when only the notable ones are asked for.
local function notable(row, copies, live_copies)
  if not notable_only or row.state == 'pending' then return true end
  if row.state == 'committed' then
    for _, c in ipairs(live_copies or copies) do
      if c < row.replicas then return true end
    end
  end
  for _, d in ipairs(row.digests) do
    if wanted[d] then return true end
  end
  return false
end
local current = {}  -- name (as JSON) -> its current vkey, read once per name
local out = {}
for _, row in ipairs(rows) do
  local copies = copies_among(row.digests)
  local live_copies = live and copies_live(row.digests)
  if notable(row, copies, live_copies) then
    local name, state, vkey = row.name, row.state, row.vkey
    if current[name] == nil then
      current[name] = redis.call('HGET', KEYS[4], cjson.decode(name)) or false
    end
    local settled, reason = row.settled, '""'
    if state ~= 'committed' then
      settled = redis.call('SCARD', KEYS[hash_of[vkey] + 1])
    end
    if state == 'aborted' then
      reason = cjson.encode(redis.call('HGET', KEYS[hash_of[vkey]], 'reason') or '')
    end
    local least, under = row.replicas, {}
    for i, c in ipairs(copies) do
      if c < least then least = c end
      if c < row.replicas then under[#under + 1] = i - 1 end
    end
    local raw = row.raw
    out[#out + 1] = (with_digests and string.sub(raw, 1, -2) or string.sub(raw, 1, row.at - 1))
      .. ',"vkey":"' .. vkey .. '","state":"' .. state
      .. '","current":' .. tostring(current[name] == vkey)
      .. ',"transfers_settled":' .. settled .. ',"reason":' .. reason
      .. ',"copies":[' .. table.concat(copies, ',') .. ']'
      .. ',"min_copies":' .. least
      .. ',"under_replicated":[' .. table.concat(under, ',') .. ']'
      .. ',"live":' .. (live_copies and '[' .. table.concat(live_copies, ',') .. ']' or 'null')
      .. '}'
  end
end
return {'[' .. table.concat(out, ',') .. ']', scores[taken], vkeys[taken], more and '1' or '0'}
