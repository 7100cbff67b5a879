--[[
  queued | running | failed -> running, by the task that picked the request up (a replay
  or a re-drive runs it again); a done request stays done.

  Input:
    KEYS[1] REQUEST: the request's record
    ARGV[1] boot: boot id of the worker
    ARGV[2] now: unix time (s)

  Output:
    the state found (or "missing"); "done": do not run it again
]]
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'done' then return state or 'missing' end
redis.call('HSET', KEYS[1], 'state', 'running', 'boot', ARGV[1], 'started_at', ARGV[2])
return state
