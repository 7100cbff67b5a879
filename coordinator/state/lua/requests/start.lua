--[[
  queued | running | failed -> running, by the task that picked the request up (a replay
  or a re-drive runs it again); a done request stays done. A request another run holds
  (its lease, on the Redis clock, not yet lapsed) stays with that run: a second delivery
  of its task while the first still runs must not run it again at the same time.

  Input:
    KEYS[1] REQUEST: the request's record
    ARGV[1] boot: boot id of the worker
    ARGV[2] now: unix time (s)
    ARGV[3] owner: this run ("boot:pid")
    ARGV[4] lease_ms: how long the lease holds unless renewed
    ARGV[5] dead_owner: a run known to be dead (its lease is taken at once), or ""

  Output:
    {state found (or "missing"), the run holding it or "", ms its lease has left};
    "done": do not run it again; a holder: another run has it, try again later
]]
--- @include "now_ms"
local state = redis.call('HGET', KEYS[1], 'state')
if not state or state == 'done' then return {state or 'missing', '', 0} end
local now = now_ms()
if state == 'running' then
  local owner = redis.call('HGET', KEYS[1], 'owner') or ''
  local lease_until = tonumber(redis.call('HGET', KEYS[1], 'lease_until') or '0')
  if owner ~= '' and owner ~= ARGV[3] and owner ~= ARGV[5] and lease_until > now then
    redis.call('HINCRBY', KEYS[1], 'deferred', 1)
    return {state, owner, lease_until - now}
  end
end
redis.call('HSET', KEYS[1], 'state', 'running', 'boot', ARGV[1], 'started_at', ARGV[2],
           'owner', ARGV[3], 'lease_until', now + tonumber(ARGV[4]))
return {state, '', 0}
