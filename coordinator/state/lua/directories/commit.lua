--[[
  Records a directory version whose every file is committed, and makes it current if its
  store was accepted after the current one's (a directory recorded before sequence numbers
  has none: any wins), in one step: a reader sees the new directory whole or the old one.

  Input:
    KEYS[1] DIRECTORY: the directory hash
    ARGV[1] field: the version's field ("version:<id>")
    ARGV[2] record: the version's record, JSON
    ARGV[3] version_id: the version id
    ARGV[4] seq: the store's sequence number

  Output:
    1 if it became current, else 0
]]
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local current = tonumber(redis.call('HGET', KEYS[1], 'current_seq') or '-1')
if tonumber(ARGV[4]) > current then
  redis.call('HSET', KEYS[1], 'current', ARGV[3], 'current_seq', ARGV[4])
  return 1
end
return 0
