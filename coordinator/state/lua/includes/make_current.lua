-- Makes `vkey` the name's current version if its request is the latest accepted one
-- (its sequence number above the one that made the current version current); 1 if it is
-- current now. A version current already still takes the later sequence number: a store
-- of the current bytes accepted after a pending one is the latest request, and the
-- pending one must not take the name when it commits. kcur: CURRENT, kseq: CURRENT_SEQ,
-- both passed by the caller in KEYS.
local function make_current(kcur, kseq, name, vkey, seq)
  local later = seq > tonumber(redis.call('HGET', kseq, name) or '0')
  if redis.call('HGET', kcur, name) == vkey then
    if later then redis.call('HSET', kseq, name, seq) end
    return 1
  end
  if later then
    redis.call('HSET', kcur, name, vkey)
    redis.call('HSET', kseq, name, seq)
    return 1
  end
  return 0
end
