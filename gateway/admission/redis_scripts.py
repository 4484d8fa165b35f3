"""The Redis quota store's Lua scripts, each run atomically by Redis (`gateway.admission.redis_store` holds the keys'
layout and when each runs). Times come from Redis' TIME, so gateways with skewed clocks share one window.
- CHECK: every limit of a tenant tested and, when all pass, its lease and counts taken (O(log leases));
- RELEASE: leases freed (a tombstone for one not found: its check has not run), token deltas charged, a request not
  admitted taken out of its minute (O(log leases) each);
- RENEW: a gateway's live leases renewed, put back where Redis lost them (O(log leases) each);
- ADOPT: the grants made from memory while Redis was away counted there, in the minutes they were made in, and the
  live ones' leases added (O(log leases) each).
"""

# Redis' clock, in every script: now (ms), the clock minute and the UTC day (the windows' keys)
_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local minute, day = math.floor(now / 60000), math.floor(now / 86400000)
"""

CHECK = (
    _CLOCK
    + """
local base = ARGV[1] .. ':{' .. ARGV[2] .. '}:'
local ck, rk, tk, dk = base .. 'conc', base .. 'req:' .. minute, base .. 'tok:' .. minute, base .. 'day:' .. day
local max_conc, rpm, tpm, tpd = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local tokens, lease_ms = tonumber(ARGV[7]), tonumber(ARGV[9])
if redis.call('DEL', base .. 'gone:' .. ARGV[8]) == 1 then return {'gone', 0, 0, 0, 0, 0, 0, -1} end
redis.call('ZREMRANGEBYSCORE', ck, '-inf', now)
local conc = redis.call('ZCARD', ck)
local reqs = tonumber(redis.call('GET', rk) or '0')
local toks = tonumber(redis.call('GET', tk) or '0')
local dtoks = tonumber(redis.call('GET', dk) or '0')
local to_min, to_day = 60000 - now % 60000, 86400000 - now % 86400000
local reason, retry = '', 0
if max_conc > 0 and conc >= max_conc then reason, retry = 'concurrency', 1000
elseif rpm > 0 and reqs + 1 > rpm then reason, retry = 'requests', to_min
elseif tpm > 0 and toks > 0 and toks + tokens > tpm then reason, retry = 'tokens', to_min
elseif tpd > 0 and dtoks > 0 and dtoks + tokens > tpd then reason, retry = 'daily_tokens', to_day
end
if reason == '' then
  redis.call('ZADD', ck, now + lease_ms, ARGV[8])
  redis.call('PEXPIRE', ck, lease_ms * 2)
  reqs = redis.call('INCR', rk)
  redis.call('PEXPIRE', rk, 120000)
  toks = redis.call('INCRBY', tk, tokens)
  redis.call('PEXPIRE', tk, 120000)
  dtoks = redis.call('INCRBY', dk, tokens)
  redis.call('PEXPIRE', dk, 172800000)
end
return {reason, retry, reqs, toks, to_min, dtoks, to_day, minute}
"""
)

RELEASE = (
    _CLOCK
    + """
local lease_ms = tonumber(ARGV[2])
for i = 3, #ARGV, 4 do
  local base = ARGV[1] .. ':{' .. ARGV[i] .. '}:'
  if redis.call('ZREM', base .. 'conc', ARGV[i + 1]) == 0 then
    redis.call('SET', base .. 'gone:' .. ARGV[i + 1], 1, 'PX', lease_ms * 2)
  end
  local refused = tonumber(ARGV[i + 3])
  if refused == minute then
    local rk = base .. 'req:' .. refused
    if tonumber(redis.call('GET', rk) or '0') > 0 then redis.call('DECR', rk) end
  end
  local delta = tonumber(ARGV[i + 2])
  if delta ~= 0 then
    for _, key in ipairs({base .. 'tok:' .. minute, base .. 'day:' .. day}) do
      local ttl = (key == base .. 'tok:' .. minute) and 120000 or 172800000
      if redis.call('INCRBY', key, delta) < 0 then redis.call('SET', key, 0) end
      redis.call('PEXPIRE', key, ttl)
    end
  end
end
return 1
"""
)

RENEW = (
    _CLOCK
    + """
local lease_ms = tonumber(ARGV[2])
local lost = redis.call('EXISTS', ARGV[3]) == 0
for i = 4, #ARGV, 2 do
  local ck = ARGV[1] .. ':{' .. ARGV[i] .. '}:conc'
  if lost then
    redis.call('ZADD', ck, now + lease_ms, ARGV[i + 1])
  else
    redis.call('ZADD', ck, 'XX', now + lease_ms, ARGV[i + 1])
  end
  redis.call('PEXPIRE', ck, lease_ms * 2)
end
redis.call('SET', ARGV[3], 1, 'PX', lease_ms * 2)
if lost then return 1 end
return 0
"""
)

ADOPT = (
    _CLOCK
    + """
local lease_ms = tonumber(ARGV[2])
for i = 3, #ARGV, 5 do
  local base = ARGV[1] .. ':{' .. ARGV[i] .. '}:'
  local m = tonumber(ARGV[i + 4])
  if m < 0 then m = minute end
  local d = math.floor(m / 1440)
  local ck, rk, tk, dk = base .. 'conc', base .. 'req:' .. m, base .. 'tok:' .. m, base .. 'day:' .. d
  if ARGV[i + 1] ~= '' then
    redis.call('ZADD', ck, now + lease_ms, ARGV[i + 1])
    redis.call('PEXPIRE', ck, lease_ms * 2)
  end
  redis.call('INCRBY', rk, tonumber(ARGV[i + 2]))
  redis.call('PEXPIRE', rk, 120000)
  redis.call('INCRBY', tk, tonumber(ARGV[i + 3]))
  redis.call('PEXPIRE', tk, 120000)
  redis.call('INCRBY', dk, tonumber(ARGV[i + 3]))
  redis.call('PEXPIRE', dk, 172800000)
end
return 1
"""
)
