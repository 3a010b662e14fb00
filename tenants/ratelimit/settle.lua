-- Settle a reservation to the actual token count, exactly once: the counters are corrected and
-- the settlement (ARGV[3], JSON) is stored in the reservation, which then waits, without expiry,
-- for its ledger row to be written (settlement_record deletes it). The stored settlement is the
-- once-only guard: a second call changes nothing and returns the first one's settlement.
--
-- KEYS: 1 reservation hash, 2 key tok amounts, 3 key tok sum, 4 tenant tok amounts,
--       5 tenant tok sum, 6 tenant in-flight set, 7 quota counter, 8 the key's budget counter,
--       9.. keys that go with the settlement (the engine's usage records of the request)
-- ARGV: 1 member, 2 actual tokens, 3 the settlement (JSON)
-- Returns {1} when settled now, {2, stored settlement} when settled before, {0} when there is no
-- reservation (left) to settle.

local resv = redis.call('HMGET', KEYS[1], 'tokens', 'quota', 'final', 'budget')
if not resv[1] then return {0} end
if resv[3] then return {2, resv[3]} end
local member = ARGV[1]
local delta = tonumber(ARGV[2]) - tonumber(resv[1])

-- Entries that already left the window no longer count; only live ones are corrected.
for _, pair in ipairs({{KEYS[2], KEYS[3]}, {KEYS[4], KEYS[5]}}) do
  if redis.call('HEXISTS', pair[1], member) == 1 then
    redis.call('HINCRBY', pair[1], member, delta)
    redis.call('INCRBY', pair[2], delta)
  end
end
redis.call('ZREM', KEYS[6], member)
-- A counter that vanished (expired, flushed) is rebuilt from the ledger by the next reserve.
if resv[2] == '1' and redis.call('EXISTS', KEYS[7]) == 1 then
  redis.call('INCRBY', KEYS[7], delta)
end
if resv[4] == '1' and redis.call('EXISTS', KEYS[8]) == 1 then
  redis.call('INCRBY', KEYS[8], delta)
end
redis.call('HSET', KEYS[1], 'final', ARGV[3])
redis.call('PERSIST', KEYS[1])
for i = 9, #KEYS do redis.call('DEL', KEYS[i]) end
return {1}
