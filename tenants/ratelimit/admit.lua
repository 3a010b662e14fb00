-- Admission in one round trip: check every limit, and only when all pass, count the request.
--
-- Sliding-window logs (exact: never more than the limit in any window, so no 2x burst at
-- window edges). Requests: a sorted set of request ids scored by arrival time. Tokens: the same
-- log, plus a hash of each entry's token count and a running sum, so the check is O(1) amortised.
-- Concurrency: a sorted set of in-flight request ids scored by lease expiry (a crashed web process
-- leaks nothing past its lease). Quota: one counter per tenant and month (seeded from the ledger
-- by the caller when missing).
--
-- KEYS: 1 key req log, 2 tenant req log,
--       3 key tok log, 4 key tok amounts, 5 key tok sum,
--       6 tenant tok log, 7 tenant tok amounts, 8 tenant tok sum,
--       9 tenant in-flight set, 10 quota counter, 11 reservation hash, 12 open settlements index,
--       13 the key's budget counter (its month's tokens)
-- ARGV: 1 window s, 2 member, 3 request cost, 4 token cost,
--       5 key rpm, 6 tenant rpm, 7 key tpm, 8 tenant tpm (-1: unlimited),
--       9 max concurrent (-1: unlimited, no slot taken), 10 monthly quota (-1: unlimited),
--       11 quota ttl s, 12 lease s, 13 reservation ttl s (0: record none),
--       14 what the settlement needs besides the counts (JSON), 15 its member in the index,
--       16 the key's monthly token budget (-1: none)
-- A reservation is also the request's open settlement: the index lists it (scored by admission
-- time) until its ledger row is written, so a settler finds those whose owner went away.
-- Returns {status, req_limit, req_remaining, req_reset_ms, tok_limit, tok_remaining, tok_reset_ms,
--          retry_ms, scope}; status 1 ok, 0 rate limited, 2 too many concurrent, 3 quota,
--          4 quota counter missing (seed and retry), 5 duplicate request id, 6 request too large,
--          7 the key's budget counter missing (seed and retry), 8 the key's budget.

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local member = ARGV[2]
local req_cost = tonumber(ARGV[3])
local tok_cost = tonumber(ARGV[4])
local horizon = now - window

local function ms(seconds)
  if seconds < 0 then return 0 end
  return math.ceil(seconds * 1000)
end

-- Request log: returns ok, remaining_after, reset_ms, retry_ms.
local function check_requests(log, limit)
  redis.call('ZREMRANGEBYSCORE', log, '-inf', horizon)
  local count = redis.call('ZCARD', log)
  if count + req_cost > limit then
    local idx = count + req_cost - limit - 1
    local entry = redis.call('ZRANGE', log, idx, idx, 'WITHSCORES')
    local retry = window
    if entry[2] then retry = tonumber(entry[2]) + window - now end
    return false, 0, ms(retry), ms(retry)
  end
  local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
  local reset = 0
  if req_cost > 0 then reset = window elseif newest[2] then reset = tonumber(newest[2]) + window - now end
  return true, limit - count - req_cost, ms(reset), 0
end

local function prune_tokens(log, amounts, sum)
  local expired = redis.call('ZRANGEBYSCORE', log, '-inf', horizon)
  if #expired > 0 then
    local vals = redis.call('HMGET', amounts, unpack(expired))
    local gone = 0
    for _, v in ipairs(vals) do gone = gone + (tonumber(v) or 0) end
    redis.call('DECRBY', sum, gone)
    redis.call('HDEL', amounts, unpack(expired))
    redis.call('ZREMRANGEBYSCORE', log, '-inf', horizon)
  end
  return tonumber(redis.call('GET', sum) or '0')
end

-- Token log: returns ok, remaining_after, reset_ms, retry_ms, too_large.
local function check_tokens(log, amounts, sum_key, limit)
  local sum = prune_tokens(log, amounts, sum_key)
  if tok_cost > limit then return false, math.max(limit - sum, 0), ms(window), ms(window), true end
  if tok_cost > 0 and sum + tok_cost > limit then
    local entries = redis.call('ZRANGE', log, 0, -1, 'WITHSCORES')
    local freed = 0
    local retry = window
    for i = 1, #entries, 2 do
      freed = freed + (tonumber(redis.call('HGET', amounts, entries[i])) or 0)
      if sum - freed + tok_cost <= limit then
        retry = tonumber(entries[i + 1]) + window - now
        break
      end
    end
    return false, math.max(limit - sum, 0), ms(retry), ms(retry), false
  end
  local newest = redis.call('ZRANGE', log, -1, -1, 'WITHSCORES')
  local reset = 0
  if tok_cost > 0 then reset = window elseif newest[2] then reset = tonumber(newest[2]) + window - now end
  return true, limit - sum - tok_cost, ms(reset), 0, false
end

local reservation_ttl = tonumber(ARGV[13])
if reservation_ttl > 0 and redis.call('EXISTS', KEYS[11]) == 1 then
  return {5, -1, -1, 0, -1, -1, 0, 0, 'request'}
end

-- Headers report the tighter of the key and tenant scopes.
local req = {-1, -1, 0}
local tok = {-1, -1, 0}
local function tighter(best, limit, remaining, reset)
  if best[1] < 0 or remaining < best[2] then return {limit, remaining, reset} end
  return best
end

-- Evaluate every scope (for complete headers), remembering the first refusal.
local denied = nil
local req_scopes = {{KEYS[1], tonumber(ARGV[5]), 'key'}, {KEYS[2], tonumber(ARGV[6]), 'tenant'}}
for _, s in ipairs(req_scopes) do
  if s[2] >= 0 then
    local ok, remaining, reset, retry = check_requests(s[1], s[2])
    if not ok and not denied then denied = {0, retry, s[3] .. ' requests per minute'} end
    req = tighter(req, s[2], remaining, reset)
  end
end

local tok_scopes = {
  {KEYS[3], KEYS[4], KEYS[5], tonumber(ARGV[7]), 'key'},
  {KEYS[6], KEYS[7], KEYS[8], tonumber(ARGV[8]), 'tenant'},
}
for _, s in ipairs(tok_scopes) do
  if s[4] >= 0 then
    local ok, remaining, reset, retry, too_large = check_tokens(s[1], s[2], s[3], s[4])
    if not ok and not denied then
      local status = 0
      if too_large then status = 6 end
      denied = {status, retry, s[5] .. ' tokens per minute'}
    end
    tok = tighter(tok, s[4], remaining, reset)
  end
end
if denied then
  return {denied[1], req[1], req[2], req[3], tok[1], tok[2], tok[3], denied[2], denied[3]}
end

local max_conc = tonumber(ARGV[9])
if max_conc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now)
  if redis.call('ZCARD', KEYS[9]) >= max_conc then
    return {2, req[1], req[2], req[3], tok[1], tok[2], tok[3], 1000, 'tenant concurrent requests'}
  end
end

-- A month's counter (the tenant's quota, the key's budget): nil when it admits the tokens, else
-- the reply (the counter is missing: seed it; or it is used up).
local function check_month(counter, limit, unseeded, exceeded, scope)
  if limit < 0 then return nil end
  local used = redis.call('GET', counter)
  if not used then return {unseeded, -1, -1, 0, -1, -1, 0, 0, scope} end
  if tonumber(used) + tok_cost > limit then
    return {exceeded, req[1], req[2], req[3], tok[1], tok[2], tok[3], 0, 'monthly token ' .. scope}
  end
  return nil
end

local quota = tonumber(ARGV[10])
local budget = tonumber(ARGV[16])
local refused = check_month(KEYS[10], quota, 4, 3, 'quota') or check_month(KEYS[13], budget, 7, 8, 'budget of the key')
if refused then return refused end
local quota_charged, budget_charged = 0, 0

-- Every check passed: count the request everywhere at once.
for _, s in ipairs(req_scopes) do
  if s[2] >= 0 and req_cost > 0 then
    redis.call('ZADD', s[1], now, member)
    redis.call('PEXPIRE', s[1], ms(window + 1))
  end
end
for _, s in ipairs(tok_scopes) do
  if s[4] >= 0 and tok_cost > 0 then
    redis.call('ZADD', s[1], now, member)
    redis.call('HSET', s[2], member, tok_cost)
    redis.call('INCRBY', s[3], tok_cost)
    for k = 1, 3 do redis.call('PEXPIRE', s[k], ms(window + 1)) end
  end
end
if max_conc >= 0 then
  redis.call('ZADD', KEYS[9], now + tonumber(ARGV[12]), member)
  redis.call('PEXPIRE', KEYS[9], ms(tonumber(ARGV[12]) + 1))
end
if quota >= 0 and tok_cost > 0 then
  redis.call('INCRBY', KEYS[10], tok_cost)
  redis.call('EXPIRE', KEYS[10], tonumber(ARGV[11]))
  quota_charged = 1
end
if budget >= 0 and tok_cost > 0 then
  redis.call('INCRBY', KEYS[13], tok_cost)
  redis.call('EXPIRE', KEYS[13], tonumber(ARGV[11]))
  budget_charged = 1
end
if reservation_ttl > 0 then
  redis.call('HSET', KEYS[11], 'tokens', tok_cost, 'quota', quota_charged, 'budget', budget_charged, 'meta', ARGV[14])
  redis.call('EXPIRE', KEYS[11], reservation_ttl)
  redis.call('ZADD', KEYS[12], now, ARGV[15])
end
return {1, req[1], req[2], req[3], tok[1], tok[2], tok[3], 0, ''}
