"""The Lua scripts of the Redis buffer (``redis_buffer``): each one atomic, one round trip.

Pure text, no I/O: the buffer registers them. Every script that compares batch ids shares
the prelude, so "newer" means the same everywhere.
"""

from __future__ import annotations

#: The floor of a query that has no blob (APPLY's floor argument): only Redis' batch decides.
NO_BLOB = -1

# Shared by the scripts: newer(a, b) compares canonical decimal batch ids exactly (length,
# then bytes: no float rounding above 2**53); batch(s) is true for a canonical decimal batch
# id (a Java long: no sign, no leading zero, at most 2**63-1), false for anything else that a
# damaged record may hold; `now` is Redis' clock in milliseconds.
_PRELUDE = """
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function batch(s)
  if not s or not (s == '0' or string.find(s, '^[1-9]%d*$')) then return false end
  return #s < 19 or (#s == 19 and s <= '9223372036854775807')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS[1] pending zset, KEYS[2] queries set, KEYS[3] names hash, KEYS[3+i] hash of update i
# (declared, unlike SNAPSHOT's reads: during a Cluster slot migration Redis then redirects the
# call instead of letting it write a hash that has already moved).
# ARGV[2i-1]: "<floor> <batch id> <query id> <name>", ARGV[2i]: its checkpoint JSON. Floor:
# the batch the query's blob holds (sidecar.flush.blob_state; "" or "-1": none), or "?" when
# the daemon has not read the blob yet; batch id: canonical decimal; query id: no spaces
# (sidecar.model.checkpoint.Id); name: the rest ("" if none). One argument for the small fields
# rather than one each: redis-py packs every argument in Python, which costs the daemon more
# than the match costs the script.
# Returns one result per update: 1 applied (APPLY_ROWS: its row, below), 0 stale (not newer
# than Redis' batch), -2 below the floor only (newer than Redis' batch, or Redis has none, but
# not newer than the floor: the blob may have been rewound by another owner since the floor
# was read; nothing was written), -1 floor needed (Redis holds no batch of the query and the
# floor is "?": nothing was written; read the blob and call again with its batch).
# A damaged record (docs/decisions.md, "Corrupted records"): any update replaces one whose
# batch_id is unreadable, the next newer batch one whose checkpoint is (a readable batch_id
# stays monotonic); counters that are not integers restart from 0, so HINCRBY cannot fail
# the call and with it the other queries' updates.
_APPLY = (
    _PRELUDE
    + """
local function counter(s)
  return s and #s <= 18 and string.find(s, '^%-?%d+$') ~= nil
end
local out = {}
for i = 1, #KEYS - 3 do
  local key = KEYS[i + 3]
  local floor, id, qid, name = string.match(ARGV[2 * i - 1], '^(%S*) (%S+) (%S+) (.*)$')
  local cur = redis.call('HMGET', key, 'batch_id', 'pending', 'version')
  if floor == '?' and not batch(cur[1]) then
    out[i] = -1
  elseif batch(cur[1]) and not newer(id, cur[1]) then
    out[i] = 0
  elseif batch(floor) and not newer(id, floor) then
    out[i] = -2
  else
    if cur[2] and not counter(cur[2]) then redis.call('HSET', key, 'pending', 0) end
    if cur[3] and not counter(cur[3]) then redis.call('HSET', key, 'version', 0) end
    local pending = redis.call('HINCRBY', key, 'pending', 1)
    local version = redis.call('HINCRBY', key, 'version', 1)
    redis.call('HSET', key, 'batch_id', id, 'checkpoint', ARGV[2 * i], 'updated_ms', now)
    if pending == 1 then
      redis.call('HSET', key, 'first_pending_ms', now)
      redis.call('ZADD', KEYS[1], now, qid)
    end
    redis.call('SADD', KEYS[2], qid)
    if name ~= '' then redis.call('HSET', KEYS[3], name, qid) end
    out[i] = APPLIED
  end
end
return out
"""
)
APPLY = _APPLY.replace("APPLIED", "1")
# The same, each applied update answered with its row as the flusher needs it (blob ack mode:
# the flush of a waiting ack then reads nothing from Redis): {1, pending, version,
# first_pending_ms, flushed_batch_id, resets, flushed_reset, now}; an absent field is false (a
# nil would end the list).
APPLY_ROWS = _APPLY.replace(
    "APPLIED",
    "{1, pending, version, "
    "redis.call('HGET', key, 'first_pending_ms') or false, "
    "redis.call('HGET', key, 'flushed_batch_id') or false, "
    "redis.call('HGET', key, 'resets') or false, "
    "redis.call('HGET', key, 'flushed_reset') or false, now}",
)

# The query ids a flush check looks at: every one in the pending index (KEYS[1]) when
# ARGV[2] is '1', then the ids ARGV[3..] (extra ones: those with acks waiting on the blob, or
# exactly the due ones), each once.
_IDS = """
local t = redis.call('TIME')
local out = {tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}
local ids = {}
if ARGV[2] == '1' then ids = redis.call('ZRANGE', KEYS[1], 0, -1) end
local seen = {}
for _, qid in ipairs(ids) do seen[qid] = true end
for i = 3, #ARGV do
  if not seen[ARGV[i]] then table.insert(ids, ARGV[i]); seen[ARGV[i]] = true end
end
"""

# What a flush check needs to decide which queries are due, without their checkpoints (a
# checkpoint is KBs with wide topics; these fields are a few bytes): one ZRANGE of the
# pending index and one HMGET per query. KEYS[1] pending zset; ARGV[1] query hash prefix;
# ARGV[2], ARGV[3..] as in _IDS. Returns {now_ms, {qid, pending, first_pending_ms,
# flushed_batch_id, batch_id, resets, flushed_reset}, ...}; absent fields are nil.
PENDING = (
    _IDS
    + """
for _, qid in ipairs(ids) do
  local h = redis.call('HMGET', ARGV[1] .. qid, 'pending', 'first_pending_ms',
                       'flushed_batch_id', 'batch_id', 'resets', 'flushed_reset')
  table.insert(out, {qid, h[1], h[2], h[3], h[4], h[5], h[6]})
end
return out
"""
)

# Everything the flusher needs to flush, read atomically with Redis' clock: the rows of the
# due queries (ARGV[2] '0', ARGV[3..] their ids), or of every pending one (ARGV[2] '1').
# KEYS[1] pending zset. ARGV[1] query hash prefix. The query hashes are not in KEYS because
# they are found inside; they share KEYS[1]'s hash tag, so one Cluster slot.
# Returns {now_ms, {qid, pending, first_pending_ms, version, batch_id, checkpoint,
# flushed_batch_id, resets, flushed_reset}, ...}; absent fields are nil.
SNAPSHOT = (
    _IDS
    + """
for _, qid in ipairs(ids) do
  local h = redis.call('HMGET', ARGV[1] .. qid, 'pending', 'first_pending_ms', 'version',
                       'batch_id', 'checkpoint', 'flushed_batch_id', 'resets', 'flushed_reset')
  table.insert(out, {qid, h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8]})
end
return out
"""
)

# What the audit of the store compares its listing with (``sidecar.flush.flusher``): every
# query of the namespace (KEYS[2], the queries set) with a flushed batch, and the blob's
# version that flush left. KEYS[1] unused (the namespace's slot); ARGV[1] query hash prefix.
# Returns {qid, flushed_batch_id, flushed_version, ...} (flat); a query without a flushed batch
# or version is left out.
FLUSHED = """
local out = {}
for _, qid in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  local h = redis.call('HMGET', ARGV[1] .. qid, 'flushed_batch_id', 'flushed_version')
  if h[1] and h[2] and h[2] ~= '' then
    table.insert(out, qid); table.insert(out, h[1]); table.insert(out, h[2])
  end
end
return out
"""

# After a successful flush: record the durable batch and clear the pending state, but only
# what the flushed snapshot covered, so an update applied meanwhile is not lost. With the batch,
# the reset record of the document the blob holds at it (``flushed_reset``: its ``reset_at``,
# "" for none): a blob later read below the flushed batch is told apart by it as a store that
# lost writes (the same record: rewritten) or a reset this Redis never recorded (another: left).
# With them, the blob's version (ETag) as the flush left it (``flushed_version``; "" unknown):
# the store's listing is audited against it (a blob at another version may have gone back).
# KEYS[1] query hash, KEYS[2] pending zset.
# ARGV: query id, version at snapshot, pending at snapshot, snapshot time (ms), durable batch,
# its document's reset record, the blob's version.
# Returns the updates still pending.
MARK_FLUSHED = (
    _PRELUDE
    + """
local flushed = redis.call('HGET', KEYS[1], 'flushed_batch_id')
if batch(flushed) and newer(flushed, ARGV[5]) then
  -- a stale mark (a newer flush was already recorded): it must not clear newer updates
  return tonumber(redis.call('HGET', KEYS[1], 'pending') or '0')
end
redis.call('HSET', KEYS[1], 'flushed_batch_id', ARGV[5], 'flushed_ms', now,
           'flushed_reset', ARGV[6], 'flushed_version', ARGV[7])
local left = 0
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[2] then
  left = redis.call('HINCRBY', KEYS[1], 'pending', -tonumber(ARGV[3]))
end
-- A batch newer than the one now in the blob is still owed a write, whatever the counters say:
-- they restart when Redis lost the record and an update re-created it during the flush, so an
-- equal version can be another record's.
local cur = redis.call('HGET', KEYS[1], 'batch_id')
if left <= 0 and batch(cur) and newer(cur, ARGV[5]) then
  left = 1
  redis.call('HSET', KEYS[1], 'pending', 1)
end
if left <= 0 then
  redis.call('HSET', KEYS[1], 'pending', 0)
  redis.call('HDEL', KEYS[1], 'first_pending_ms')
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 0
end
-- Updates arrived after the snapshot; none is older than the snapshot itself.
redis.call('HSET', KEYS[1], 'first_pending_ms', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return left
"""
)

# A reset (checkpoint-sidecar reset): the query's record becomes the given checkpoint, as
# flushed (the caller writes the blob under its lease), so the flusher never writes the
# replaced batch back; later updates must be newer than it (the apply script compares). It
# counts itself in `resets`, which every row carries: a daemon that saw the blob at a higher
# batch learns from it that the blob was lowered (a lower flushed batch alone may only lag).
# Refused while an update was applied within the quiet time (the query may be running).
# KEYS[1] query hash, KEYS[2] pending zset, KEYS[3] queries set, KEYS[4] names hash (KEYS[5],
# the restores hash, is RETIRE's). ARGV: query id, batch id, checkpoint JSON, name ("" none),
# quiet ms (-1: force), the reset record of the document the caller writes next (its
# ``reset_at``: MARK_FLUSHED's ``flushed_reset``).
# Returns {1, ms since the last applied update} when refused, else {0, the batch it replaced
# (false: none), the updates it dropped unflushed}. The name is recorded only when Redis has
# none for it (a reset by id never redirects a name to an older query).
RESET = (
    _PRELUDE
    + """
local cur = redis.call('HMGET', KEYS[1], 'batch_id', 'pending', 'updated_ms', 'version')
local updated = tonumber(cur[3] or '')
if tonumber(ARGV[5]) >= 0 and updated and now - updated < tonumber(ARGV[5]) then
  return {1, now - updated}
end
local version = (tonumber(cur[4] or '0') or 0) + 1
redis.call('HSET', KEYS[1], 'batch_id', ARGV[2], 'checkpoint', ARGV[3], 'version', version,
           'pending', 0, 'flushed_batch_id', ARGV[2], 'flushed_ms', now,
           'flushed_reset', ARGV[6], 'flushed_version', '')
redis.call('HINCRBY', KEYS[1], 'resets', 1)
redis.call('HDEL', KEYS[1], 'first_pending_ms')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
if ARGV[4] ~= '' then redis.call('HSETNX', KEYS[4], ARGV[4], ARGV[1]) end
return {0, cur[1] or false, tonumber(cur[2] or '0') or 0}
"""
)

# Retiring a query (checkpoint-sidecar retire): its hash, its place in the pending and queries
# sets, every name pointing at it and its restore record (KEYS[5]) are removed. Same keys as
# RESET; ARGV: query id, quiet
# ms (-1: force). Returns {1, ms since the last applied update} when refused, else {0, the
# number of keys and entries removed}.
RETIRE = (
    _PRELUDE
    + """
local updated = tonumber(redis.call('HGET', KEYS[1], 'updated_ms') or '')
if tonumber(ARGV[2]) >= 0 and updated and now - updated < tonumber(ARGV[2]) then
  return {1, now - updated}
end
local removed = redis.call('DEL', KEYS[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
  + redis.call('SREM', KEYS[3], ARGV[1]) + redis.call('HDEL', KEYS[5], ARGV[1])
local names = redis.call('HGETALL', KEYS[4])
for i = 1, #names, 2 do
  if names[i + 1] == ARGV[1] then removed = removed + redis.call('HDEL', KEYS[4], names[i]) end
end
return {0, removed}
"""
)
