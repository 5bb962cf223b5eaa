"""The Redis store's server-side scripts: each admission, reservation, settlement or lease is one
atomic script, so gateways sharing a key never interleave a read and a write, and each costs one
round trip.

Time is Redis's own (``TIME``), never a gateway's: gateways with skewed clocks agree on every
bucket and every lease expiry. Layout, per key id (in braces: one key's data stays in one hash
slot):

- ``<prefix>{<key>}:req``, ``:tok`` and ``:aud`` (seconds of audio): a token bucket as a hash, ``l`` (level, may be negative:
  a debt of tokens streamed beyond a reservation) and ``t`` (the server time of ``l``), refilled
  at its capacity per minute, continuously. A full bucket is an absent key: each write sets the
  key to expire when the bucket would be full again.
- ``<prefix>{<key>}:lease:session`` and ``:lease:running``: sorted sets of lease members scored by
  their expiry; expired members are dropped by every script that reads the set.
"""

from __future__ import annotations

_PRELUDE = """
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local function num(x)
  return string.format('%.17g', x)
end

local function level(key, cap, now)
  local v = redis.call('HMGET', key, 'l', 't')
  local l, t = tonumber(v[1]), tonumber(v[2])
  if l == nil or t == nil then
    return cap
  end
  local elapsed = math.max(0, now - t)
  return math.min(cap, l + elapsed * cap / 60)
end

local function store(key, cap, l, now)
  if l >= cap then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'l', num(l), 't', num(now))
  redis.call('PEXPIRE', key, math.ceil((cap - l) * 60000 / cap) + 1000)
end

local function purge(key, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', num(now))
end

local function hold(key, member, now, ttl)
  redis.call('ZADD', key, num(now + ttl), member)
  local ms = math.ceil(ttl * 1000) + 1000
  if redis.call('PTTL', key) < ms then
    redis.call('PEXPIRE', key, ms)
  end
end
"""

# KEYS: req, tok. ARGV: rpm, tpm. -> {admitted, refused bucket, req level, tok level}
ADMIT = _PRELUDE + """
local now = now_s()
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local req, tok = level(KEYS[1], rpm, now), level(KEYS[2], tpm, now)
if tok < 1 then
  return {0, 'tokens', num(req), num(tok)}
end
if req < 1 then
  return {0, 'requests', num(req), num(tok)}
end
req = req - 1
store(KEYS[1], rpm, req, now)
return {1, '', num(req), num(tok)}
"""

# KEYS: req, tok, running. ARGV: rpm, tpm, running cap, tokens, member, ttl s.
# -> {reserved, refused by, running count, req level, tok level}
RESERVE = _PRELUDE + """
local now = now_s()
local rpm, tpm, cap, n, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[6])
local req, tok = level(KEYS[1], rpm, now), level(KEYS[2], tpm, now)
purge(KEYS[3], now)
local running = redis.call('ZCARD', KEYS[3])
if running >= cap then
  return {0, 'running', running, num(req), num(tok)}
end
if tok < n then
  return {0, 'tokens', running, num(req), num(tok)}
end
tok = tok - n
store(KEYS[2], tpm, tok, now)
hold(KEYS[3], ARGV[5], now, ttl)
return {1, '', running + 1, num(req), num(tok)}
"""

# KEYS: req, tok, running. ARGV: rpm, tpm, tokens to charge (negative: refund), member.
# -> {req level, tok level}
SETTLE = _PRELUDE + """
local now = now_s()
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local req = level(KEYS[1], rpm, now)
local tok = math.min(tpm, level(KEYS[2], tpm, now) - tonumber(ARGV[3]))
store(KEYS[2], tpm, tok, now)
redis.call('ZREM', KEYS[3], ARGV[4])
return {num(req), num(tok)}
"""

# KEYS: aud. ARGV: audio seconds per minute, seconds to charge. -> {charged, level after}
SPEND = _PRELUDE + """
local now = now_s()
local cap = tonumber(ARGV[1])
local aud = level(KEYS[1], cap, now)
if aud < 1 then
  return {0, num(aud)}
end
aud = aud - tonumber(ARGV[2])
store(KEYS[1], cap, aud, now)
return {1, num(aud)}
"""

# KEYS: req, tok. ARGV: rpm, tpm. -> {req level, tok level}
SNAPSHOT = _PRELUDE + """
local now = now_s()
return {num(level(KEYS[1], tonumber(ARGV[1]), now)), num(level(KEYS[2], tonumber(ARGV[2]), now))}
"""

# KEYS: a lease set. ARGV: cap, member, ttl s. -> {acquired, leases in the set after}
ACQUIRE = _PRELUDE + """
local now = now_s()
purge(KEYS[1], now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then
  return {0, n}
end
hold(KEYS[1], ARGV[2], now, tonumber(ARGV[3]))
return {1, n + 1}
"""

# KEYS: the lease set of each lease. ARGV: ttl s, then the members in KEYS' order. -> count.
# Re-adds a lease that lapsed (Redis restarted empty, or was away past the TTL): its holder is alive.
RENEW = _PRELUDE + """
local now = now_s()
local ttl = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  hold(key, ARGV[i + 1], now, ttl)
end
return #KEYS
"""

# KEYS: a lease set. -> unexpired members.
COUNT = _PRELUDE + """
purge(KEYS[1], now_s())
return redis.call('ZCARD', KEYS[1])
"""
