"""The Lua scripts a replica runs on its model's request stream and on output streams: each does in
one step what must not be interleaved with another replica's commands."""

# Keep the idle clock at zero for entries this consumer still owns. Checking the owner and claiming
# in one script matters: a plain XCLAIM would take back an entry another replica had already
# reclaimed from us (after we stalled past the timeout), and both would then answer it.
TOUCH_SCRIPT = """
local owned = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    owned[#owned + 1] = ARGV[i]
  end
end
return owned
"""

# Hand entries this consumer owns back to the stream as new entries, which the next XREADGROUP '>'
# of any replica takes at once (a released pending entry waits for someone's XAUTOCLAIM, every few
# seconds). In one script: the copy is added exactly when the original is acked, and only for an
# entry still ours (one another replica reclaimed from us is its to answer). The original is
# deleted too: acked, it would keep a second copy of the prompt until trimmed. The copy is marked
# `handed`: whoever takes it looks at its output stream first, since it may have streamed.
HAND_BACK_SCRIPT = """
local handed = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    local entry = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
    if entry[1] then
      local fields = {}
      for j = 1, #entry[1][2], 2 do
        if entry[1][2][j] ~= 'handed' then
          fields[#fields + 1] = entry[1][2][j]
          fields[#fields + 1] = entry[1][2][j + 1]
        end
      end
      fields[#fields + 1] = 'handed'
      fields[#fields + 1] = '1'
      redis.call('XADD', KEYS[1], '*', unpack(fields))
    end
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
    handed[#handed + 1] = ARGV[i]
  end
end
return handed
"""

# Take a request over from a lost replica: its output stream as it stands, and, when it ends in
# the middle of an answer (a delta, or an earlier takeover's marker), a failover marker appended in
# the same script. The marker is the fence: its id is above every id the lost replica's run used,
# so anything that replica still writes (it may only have stalled) is refused as too small, and
# what came before the marker is exactly what the new holder continues from.
TAKE_OVER_SCRIPT = """
local entries = redis.call('XRANGE', KEYS[1], '-', '+')
local n = #entries
if n == 0 then
  return {entries, false}
end
local last = entries[n][2]
local data = nil
for i = 1, #last, 2 do
  if last[i] == 'data' then
    data = last[i + 1]
  end
end
local ok, decoded = pcall(cjson.decode, data or '')
if not ok or type(decoded) ~= 'table' or (decoded.type ~= 'delta' and decoded.type ~= 'failover') then
  return {entries, false}
end
local id = redis.call('XADD', KEYS[1], '*', 'data', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {entries, id}
"""

# Ack the entries of requests this consumer answered, only those it still owns: one another
# replica took over from us (we had stalled past the heartbeat TTL or the claim timeout) is that
# replica's to ack; a plain XACK would drop it from the group under its new holder.
ACK_OWNED_SCRIPT = """
local acked = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  end
end
return acked
"""
