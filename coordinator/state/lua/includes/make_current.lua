-- Makes `vkey` the name's current version if its request is the latest accepted one
-- (its sequence number above the one that made the current version current); 1 if it is
-- current now. kcur: CURRENT, kseq: CURRENT_SEQ, both passed by the caller in KEYS.
local function make_current(kcur, kseq, name, vkey, seq)
  local cur = redis.call('HGET', kcur, name)
  if cur == vkey then return 1 end
  if seq > tonumber(redis.call('HGET', kseq, name) or '0') then
    redis.call('HSET', kcur, name, vkey)
    redis.call('HSET', kseq, name, seq)
    return 1
  end
  return 0
end
