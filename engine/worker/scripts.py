"""The Lua scripts a replica runs on its model's request stream and on output streams: each does in
one step what must not be interleaved with another replica's commands."""

# A group's last-delivered id in a stream (nil when the group is not there), for the scripts below.
_LAST_DELIVERED = """
local function last_delivered(stream, group)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local name, last = nil, nil
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] elseif g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == group then return last end
  end
  return nil
end
"""

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

# Hand entries this consumer owns (in KEYS[1]) back to the model's shared stream (KEYS[2]) as new
# entries, which the next XREADGROUP '>' of any replica takes at once (a released pending entry waits for someone's XAUTOCLAIM, every few
# seconds). In one script: the copy is added exactly when the original is acked, and only for an
# entry still ours (one another replica reclaimed from us is its to answer). The original is
# deleted too (acked, it would keep a second copy of the prompt until trimmed), except when it is
# the group's last delivered entry: a deletion there leaves Redis 7 unable to tell the group's lag
# (XINFO GROUPS answers nil, which autoscalers such as KEDA read as 0) until a replica reads past
# it; kept, it leaves with the trim of answered entries. The copy is marked `handed`: whoever
# takes it looks at its output stream first, since it may have streamed.
HAND_BACK_SCRIPT = (
    _LAST_DELIVERED
    + """
local last = last_delivered(KEYS[1], ARGV[1])
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
      redis.call('XADD', KEYS[2], '*', unpack(fields))
    end
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    if ARGV[i] ~= last then redis.call('XDEL', KEYS[1], ARGV[i]) end
    handed[#handed + 1] = ARGV[i]
  end
end
return handed
"""
)

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

# A replica's read of new entries: up to ARGV[3] from its own stream (KEYS[1]), then what room is
# left from the shared stream (KEYS[2]), in one round trip. Returns {own entries, shared entries}.
READ_NEW_SCRIPT = """
local count = tonumber(ARGV[3])
local out = {{}, {}}
for k = 1, 2 do
  if count > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[k], '>')
    if reply then
      out[k] = reply[1][2]
      count = count - #out[k]
    end
  end
end
return out
"""

# The id after which a group has delivered nothing yet (its last-delivered-id), or nil.

# Steal from another replica's stream (KEYS[1]) the entries nobody has read that were added at or
# before ARGV[3] (an id: now less the steal delay), at most ARGV[4], oldest first, as consumer
# ARGV[2]. In one script: the entries counted are exactly the ones read.
STEAL_SCRIPT = (
    _LAST_DELIVERED
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
local last = last_delivered(KEYS[1], ARGV[1])
if not last then return {} end
local waiting = redis.call('XRANGE', KEYS[1], '(' .. last, ARGV[3], 'COUNT', ARGV[4])
if #waiting == 0 then return {} end
local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', #waiting, 'STREAMS', KEYS[1], '>')
if not reply then return {} end
return reply[1][2]
"""
)

# Retire replica ARGV[2]'s own stream (KEYS[1]), as it leaves or once it is lost: the entries nobody
# read move to the shared stream (KEYS[2]) as new entries; when nothing in it is pending any more,
# the stream is deleted and the replica leaves the set of routed replicas (KEYS[3]). The web tier
# queues to a replica's stream only while it exists, so nothing is added to it after. Returns how
# many entries moved.
RETIRE_SCRIPT = (
    _LAST_DELIVERED
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SREM', KEYS[3], ARGV[2])
  return 0
end
local last = last_delivered(KEYS[1], ARGV[1])
local waiting = redis.call('XRANGE', KEYS[1], '(' .. (last or '0-0'), '+')
for _, entry in ipairs(waiting) do
  redis.call('XADD', KEYS[2], '*', unpack(entry[2]))
  redis.call('XDEL', KEYS[1], entry[1])
end
local pending = 0
if last then pending = tonumber(redis.call('XPENDING', KEYS[1], ARGV[1])[1]) end
if pending == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[3], ARGV[2])
end
return #waiting
"""
)
