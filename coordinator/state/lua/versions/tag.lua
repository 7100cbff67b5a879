--[[
  Give a committed version a label (`gather NAME@LABEL`), taking it from whichever other
  version of the same name had it: a label names one version of a name at a time.

  Input:
    KEYS[1] VERSION: the version hash
    KEYS[2] VERSIONS: the versions of its name
    KEYS[3] TAGS: vkey -> its labels, space-separated
    ARGV[1] vkey: the version key
    ARGV[2] label: the label (no space)

  Output:
    the state found ("committed": it has the label now); "missing" if unknown
]]
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'committed' then return state or 'missing' end
for _, v in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local labels = redis.call('HGET', KEYS[3], v)
  if labels then
    local kept = {}
    for l in string.gmatch(labels, '%S+') do
      if l ~= ARGV[2] then table.insert(kept, l) end
    end
    if #kept == 0 then
      redis.call('HDEL', KEYS[3], v)
    else
      redis.call('HSET', KEYS[3], v, table.concat(kept, ' '))
    end
  end
end
local mine = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], mine and (mine .. ' ' .. ARGV[2]) or ARGV[2])
return state
