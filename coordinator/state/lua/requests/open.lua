--[[
  A new request (intent): its sequence number from the one counter, its record, and its
  place among the open requests, in one step. Idempotent: a request already recorded is
  left as it is (a client whose reply Redis lost asks again), and its number returned.

  Input:
    KEYS[1] SEQ: the request counter
    KEYS[2] REQUEST: the request's record
    KEYS[3] REQUESTS_OPEN: requests not yet done or failed
    ARGV[1] kind: what it asks for
    ARGV[2] host: the host that asked
    ARGV[3] args: its arguments, JSON
    ARGV[4] now: unix time (s)
    ARGV[5] rid: the request id

  Output:
    its sequence number (the one it was given, if it was recorded already)
]]
local recorded = redis.call('HGET', KEYS[2], 'seq')
if recorded then return tonumber(recorded) end
local seq = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[2], 'kind', ARGV[1], 'host', ARGV[2], 'args', ARGV[3],
           'state', 'queued', 'seq', seq, 'created_at', ARGV[4])
redis.call('ZADD', KEYS[3], seq, ARGV[5])
return seq
