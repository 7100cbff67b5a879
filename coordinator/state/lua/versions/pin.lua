--[[
  Pin a committed version: retention (the last K per name, retention per prefix) never
  removes it until it is unpinned. Only a committed version is pinned: a pending one may
  still abort, a removing one is going.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] PINS: vkey -> when it was pinned
    ARGV[1] vkey: the version key
    ARGV[2] now: unix time (s)

  Output:
    the state found ("committed": pinned now, or it already was); "missing" if unknown
]]
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'committed' then redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) end
return state or 'missing'
