-- Settle a reservation to the actual token count, exactly once (the reservation hash is the
-- once-only guard: a second call finds it gone and does nothing).
--
-- KEYS: 1 reservation hash, 2 key tok amounts, 3 key tok sum, 4 tenant tok amounts,
--       5 tenant tok sum, 6 tenant in-flight set, 7 quota counter
-- ARGV: 1 member, 2 actual tokens
-- Returns 1 when settled, 0 when there was nothing (left) to settle.

local resv = redis.call('HMGET', KEYS[1], 'tokens', 'quota')
if not resv[1] then return 0 end
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
redis.call('DEL', KEYS[1])
return 1
