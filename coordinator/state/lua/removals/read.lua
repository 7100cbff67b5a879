--[[
  A gather's reader mark on a committed version, set or refreshed until now + ttl (Redis
  server clock); retention never retires a version with an unexpired mark.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] READERS: its reader marks
    ARGV[1] reader: reader id
    ARGV[2] ttl: mark ttl (ms)

  Output:
    the state found (or "missing"); the mark is set only if it is "committed"
]]
--- @include "now_ms"
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'committed' then return state or 'missing' end
redis.call('ZADD', KEYS[2], now_ms() + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[2]))
return state
