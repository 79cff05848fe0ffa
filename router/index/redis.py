"""`RedisStore`: the index store on a Redis or Valkey server, shared by a deployment's routers.

Several router replicas of one deployment point at the same server and key prefix: what one
ingests, every other matches at once (a new replica places well from its first request), and
the index may outgrow one router process. Every contract call is one Lua script run
(EVALSHA), one atomic server-side step: readers see each write call wholly or not at all, and
`match` walks the whole chain in a single round trip. Writes are pipelined: those made while
earlier ones are on the wire (the feed runs one task per worker) go out together in the next
pipeline, in call order, so one worker's calls still apply in stream order.

Data model (P = the deployment's prefix, K = a canonical key as 8 bytes big-endian):

    P b K   string  the block's holders: a 2-byte record (big-endian slot·16 + tier bits) per
                    worker holding it, so a block held by one worker costs 2 bytes of value.
    P l     zset    every block (member K) by last use (score: a logical clock): the LRU.
    P w N   set     the blocks worker slot N holds (members K), for `drop_worker`.
    P s     hash    worker name -> slot (given on first sight, kept for the deployment's life).
    P m     hash    worker name -> "seq ts": the newest batch of its stream a router applied
                    (`mark`), cleared by `drop_worker`.
    P c     hash    counters: `n` entries, `x` evictions, `k` the clock, `m` slots given,
                    `N.T` entries of slot N under fastest tier index T (so `stats` never walks).

Bounds: a cap on (block, worker) entries (`max_entries`, the same in every replica of a
deployment), enforced at the end of each `add` like `MemoryStore`'s: oldest block first, with
all its holders, each counted in `evictions`. `add` and `match` refresh the blocks they touch
(one ZADD per call); remove, move and stats do not. Redis's own `maxmemory` eviction would drop
keys behind the counters' back, so the server should run without it (or with `noeviction`).
Costs: `drop_worker` walks the worker's set in one script (a pause of the server proportional
to its entries: rare, on a stream gap); worker slots stop at 4096 per deployment.

A call the server cannot answer (refused, timed out) raises `StoreUnavailable`; the router
keeps placing without prefix matches meanwhile (`router.placement`, `router.feed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import struct
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError

from router.index.contract import (
    IndexStats,
    IndexStore,
    StoreUnavailable,
    WorkerMatch,
    shown_url,
)
from warply.protocol import Tier

_TIERS = tuple(Tier)
_INDEX = {tier: i for i, tier in enumerate(_TIERS)}
_ALL_TIERS = (1 << len(_TIERS)) - 1
_ERRORS = (redis.ConnectionError, redis.TimeoutError)
_NONE = WorkerMatch(0, {})

_PRELUDE = """
local P = ARGV[1]
local B, L, W, S, C = P .. 'b', P .. 'l', P .. 'w', P .. 's', P .. 'c'
local byte, sub, char, floor = string.byte, string.sub, string.char, math.floor
local FAST = {}  -- tier bits -> index of the fastest tier among them (the lowest bit)
for b = 1, 15 do
  local t = 0
  while bit.band(b, bit.lshift(1, t)) == 0 do t = t + 1 end
  FAST[b] = t
end
local delta = {}  -- counter field -> change, written once at the end
local function count(slot, bits, d)
  local f = slot .. '.' .. FAST[bits]
  delta[f] = (delta[f] or 0) + d
end
local function flush(entries, evictions)
  for f, d in pairs(delta) do
    if d ~= 0 then redis.call('HINCRBY', C, f, d) end
  end
  if entries ~= 0 then redis.call('HINCRBY', C, 'n', entries) end
  if evictions ~= 0 then redis.call('HINCRBY', C, 'x', evictions) end
end
local function find(v, slot)  -- the slot's tier bits in holders `v` (0: none) and their offset
  for i = 1, #v, 2 do
    local a, b = byte(v, i, i + 1)
    local r = a * 256 + b
    if floor(r / 16) == slot then return r % 16, i end
  end
  return 0, nil
end
local function put(v, slot, bits, pos)  -- holders `v` with the slot's bits replaced (0: gone)
  local rec = ''
  if bits > 0 then
    local r = slot * 16 + bits
    rec = char(floor(r / 256), r % 256)
  end
  if pos then return sub(v, 1, pos - 1) .. rec .. sub(v, pos + 2) end
  return v .. rec
end
local function batched(cmd, head, args)  -- cmd head args..., at most 4000 arguments at a time
  for i = 1, #args, 4000 do
    redis.call(cmd, head, unpack(args, i, math.min(i + 3999, #args)))
  end
end
local function split(blob)  -- 8-byte keys and their block names
  local ks, names = {}, {}
  for i = 1, #blob / 8 do
    ks[i] = sub(blob, 8 * i - 7, 8 * i)
    names[i] = B .. ks[i]
  end
  return ks, names
end
local function mget(names)
  local out = {}
  for i = 1, #names, 4000 do
    local part = redis.call('MGET', unpack(names, i, math.min(i + 3999, #names)))
    for j = 1, #part do out[i + j - 1] = part[j] end
  end
  return out
end
local function write(cur, changed)  -- store changed holders; a block nobody holds leaves
  local set, gone = {}, {}
  for k in pairs(changed) do
    if cur[k] == '' then
      redis.call('DEL', B .. k)
      gone[#gone + 1] = k
    else
      set[#set + 1] = B .. k
      set[#set + 1] = cur[k]
    end
  end
  if #set > 0 then
    for i = 1, #set, 4000 do redis.call('MSET', unpack(set, i, math.min(i + 3999, #set))) end
  end
  if #gone > 0 then batched('ZREM', L, gone) end
end
"""

_ADD = """
local slot = redis.call('HGET', S, ARGV[2])
if not slot then
  slot = redis.call('HINCRBY', C, 'm', 1) - 1
  if slot >= 4096 then return redis.error_reply('more than 4096 workers in this index') end
  redis.call('HSET', S, ARGV[2], slot)
end
slot = tonumber(slot)
local tbit, cap = bit.lshift(1, tonumber(ARGV[3])), tonumber(ARGV[4])
local ks, names = split(ARGV[5])
local n = #ks
if n == 0 then return 0 end
local vals = mget(names)
local cur, changed, z, fresh = {}, {}, {}, {}
local clock = redis.call('HINCRBY', C, 'k', n) - n
for i = 1, n do
  local k = ks[i]
  local v = cur[k]
  if v == nil then v = vals[i] or '' end
  local old, pos = find(v, slot)
  local new = bit.bor(old, tbit)
  if new ~= old then
    if old == 0 then fresh[#fresh + 1] = k else count(slot, old, -1) end
    count(slot, new, 1)
    v = put(v, slot, new, pos)
    changed[k] = true
  end
  cur[k] = v
  z[#z + 1] = clock + i
  z[#z + 1] = k
end
write(cur, changed)
batched('ZADD', L, z)
if #fresh > 0 then batched('SADD', W .. slot, fresh) end
local entries = tonumber(redis.call('HGET', C, 'n') or 0) + #fresh
local evicted = 0
while entries - evicted > cap do  -- oldest blocks first, with every holder
  local oldest = redis.call('ZRANGE', L, 0, entries - evicted - cap - 1)
  local done = 0
  for _, k in ipairs(oldest) do
    local v = redis.call('GET', B .. k) or ''
    for i = 1, #v, 2 do
      local a, b = byte(v, i, i + 1)
      local r = a * 256 + b
      redis.call('SREM', W .. floor(r / 16), k)
      count(floor(r / 16), r % 16, -1)
      evicted = evicted + 1
    end
    redis.call('DEL', B .. k)
    done = done + 1
    if entries - evicted <= cap then break end
  end
  redis.call('ZREM', L, unpack(oldest, 1, done))
end
flush(#fresh - evicted, evicted)
return 0
"""

_REMOVE = """
local ks, names = split(ARGV[4])
local flags = {}
local slot = redis.call('HGET', S, ARGV[2])
if not slot then
  for i = 1, #ks do flags[i] = 0 end
  return flags
end
slot = tonumber(slot)
local keep = bit.bnot(tonumber(ARGV[3]))
local vals = mget(names)
local cur, changed, gone, lost = {}, {}, 0, {}
for i = 1, #ks do
  local k = ks[i]
  local v = cur[k]
  if v == nil then v = vals[i] or '' end
  local old, pos = find(v, slot)
  local left = bit.band(old, keep)
  if left ~= old then
    count(slot, old, -1)
    if left > 0 then count(slot, left, 1) else gone = gone + 1; lost[#lost + 1] = k end
    v = put(v, slot, left, pos)
    changed[k] = true
  end
  cur[k] = v
  flags[i] = left > 0 and 1 or 0
end
write(cur, changed)
if #lost > 0 then batched('SREM', W .. slot, lost) end
flush(-gone, 0)
return flags
"""

_MOVE = """
local ks, names = split(ARGV[5])
local slot = redis.call('HGET', S, ARGV[2])
if not slot then return #ks end
slot = tonumber(slot)
local keep, dst = bit.bnot(bit.lshift(1, tonumber(ARGV[3]))), bit.lshift(1, tonumber(ARGV[4]))
local vals = mget(names)
local cur, changed, absent = {}, {}, 0
for i = 1, #ks do
  local k = ks[i]
  local v = cur[k]
  if v == nil then v = vals[i] or '' end
  local old, pos = find(v, slot)
  if old == 0 then
    absent = absent + 1
  else
    local new = bit.bor(bit.band(old, keep), dst)
    if new ~= old then
      count(slot, old, -1)
      count(slot, new, 1)
      v = put(v, slot, new, pos)
      changed[k] = true
    end
  end
  cur[k] = v
end
write(cur, changed)
flush(0, 0)
return absent
"""

_MARK = """
local M = P .. 'm'
local seq, ts = tonumber(ARGV[3]), tonumber(ARGV[4])
local cur = redis.call('HGET', M, ARGV[2])
if cur then
  local s, t = string.match(cur, '^(%S+) (%S+)$')
  local oseq, ots = tonumber(s), tonumber(t)
  if ts < ots or (ts == ots and seq <= oseq) then return 0 end
end
redis.call('HSET', M, ARGV[2], ARGV[3] .. ' ' .. ARGV[4])
return 1
"""

_DROP = """
redis.call('HDEL', P .. 'm', ARGV[2])
local slot = redis.call('HGET', S, ARGV[2])
if not slot then return 0 end
slot = tonumber(slot)
local cur, changed, gone = {}, {}, 0
for _, k in ipairs(redis.call('SMEMBERS', W .. slot)) do
  local v = redis.call('GET', B .. k) or ''
  local old, pos = find(v, slot)
  if old > 0 then
    count(slot, old, -1)
    gone = gone + 1
    cur[k] = put(v, slot, 0, pos)
    changed[k] = true
  end
end
write(cur, changed)
redis.call('DEL', W .. slot)
flush(-gone, 0)
return gone
"""

_MATCH = """
local blob, m = ARGV[2], #ARGV - 2
local res, live, nlive = {}, {}, 0  -- live: slot -> candidate number, while its run goes on
for j = 1, 5 * m do res[j] = 0 end
if m == 0 then return res end
local slots = redis.call('HMGET', S, unpack(ARGV, 3))
for j = 1, m do
  if slots[j] then live[tonumber(slots[j])] = j; nlive = nlive + 1 end
end
local n, walked, step = #blob / 8, 0, 16
while nlive > 0 and walked < n do  -- fetch the chain in growing chunks while a run goes on
  local names = {}
  for i = walked + 1, math.min(walked + step, n) do
    names[#names + 1] = B .. sub(blob, 8 * i - 7, 8 * i)
  end
  step = step * 2
  local vals = redis.call('MGET', unpack(names))
  for q = 1, #vals do
    local v = vals[q]
    if not v then nlive = 0; break end
    local seen, here = {}, 0
    for p = 1, #v, 2 do
      local a, b = byte(v, p, p + 1)
      local r = a * 256 + b
      local s = floor(r / 16)
      if live[s] then seen[s] = r % 16; here = here + 1 end
    end
    if here < nlive then
      for s in pairs(live) do
        if not seen[s] then live[s] = nil; nlive = nlive - 1 end
      end
      if nlive == 0 then break end
    end
    for s, bits in pairs(seen) do
      local base = 5 * (live[s] - 1)
      res[base + 1] = res[base + 1] + 1
      res[base + 2 + FAST[bits]] = res[base + 2 + FAST[bits]] + 1
    end
    walked = walked + 1
  end
end
if walked > 0 then  -- the walked blocks count as used
  local clock = redis.call('HINCRBY', C, 'k', walked) - walked
  local z = {}
  for i = 1, walked do
    z[#z + 1] = clock + i
    z[#z + 1] = sub(blob, 8 * i - 7, 8 * i)
  end
  for i = 1, #z, 4000 do redis.call('ZADD', L, 'XX', unpack(z, i, math.min(i + 3999, #z))) end
end
-- One string: (candidate number, depth, per tier) as 32-bit big-endian integers for the
-- candidates that hold something (a reply of 5 x candidates integers costs the client more to
-- parse than the walk costs the server).
local out = {}
for j = 1, m do
  local b = 5 * j - 4
  if res[b] > 0 then
    out[#out + 1] = struct.pack('>I4I4I4I4I4I4', j, res[b], res[b + 1], res[b + 2],
                                res[b + 3], res[b + 4])
  end
end
return table.concat(out)
"""


def _pack(keys: Sequence[int]) -> bytes:
    """Canonical keys as one string of 8-byte big-endian records (what the scripts split)."""
    return struct.pack(f">{len(keys)}Q", *keys)


class RedisStore(IndexStore):
    """Index store on a Redis / Valkey server; see the module docstring for the data model."""

    def __init__(
        self,
        url: str,
        prefix: str = "warply",
        max_entries: int = 4_000_000,
        timeout_s: float = 0.5,
    ) -> None:
        if max_entries <= 0:
            raise ValueError("max_entries must be positive")
        self.url = url
        self.max_entries = max_entries
        self._prefix = f"{{{prefix}}}:".encode()  # a hash tag: one cluster slot for a deployment
        # No retries: a call that fails is reported at once, so placement stops waiting on it.
        self._redis = redis.asyncio.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        script = self._redis.register_script
        self._add = script(_PRELUDE + _ADD)
        self._remove = script(_PRELUDE + _REMOVE)
        self._move = script(_PRELUDE + _MOVE)
        self._drop = script(_PRELUDE + _DROP)
        self._mark = script(_PRELUDE + _MARK)
        self._match = script(_PRELUDE + _MATCH)
        self._pending: list[tuple[Any, tuple[Any, ...], asyncio.Future[Any]]] = []
        """Writes waiting for the next pipeline: (script, arguments, the caller's future)."""
        self._sender: asyncio.Task[None] | None = None

    def check(self) -> None:
        """Reach the server once, synchronously (at start-up); raises `StoreUnavailable`."""
        client = redis.Redis.from_url(self.url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
        except (*_ERRORS, redis.ResponseError) as exc:
            raise self._unavailable(exc) from None
        finally:
            client.close()

    @contextlib.contextmanager
    def _reaching(self) -> Iterator[None]:
        """Around a direct call to the server: its connection errors become `StoreUnavailable`."""
        try:
            yield
        except _ERRORS as exc:
            raise self._unavailable(exc) from None

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        """`exc`, a failure to reach the server, as the error callers get (no password shown)."""
        return StoreUnavailable(f"index store {shown_url(self.url)}: {exc}")

    async def _run(self, script: Any, *args: Any) -> Any:
        """One script run on its own (match: a reader does not wait behind writes)."""
        with self._reaching():
            return await script(args=[self._prefix, *args])

    async def _write(self, script: Any, *args: Any) -> Any:
        """One write script run, sent in the next pipeline; its result once applied."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((script, args, done))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send())
        return await done

    async def _send(self) -> None:
        """Send the pending writes, a pipeline at a time, until none is left."""
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                results = await self._pipeline(batch)
            except Exception as exc:  # every caller hears of it; none waits forever
                failed = exc
                if isinstance(exc, _ERRORS):
                    failed = self._unavailable(exc)
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(failed)
                continue
            for (_, _, done), result in zip(batch, results, strict=True):
                if done.done():
                    continue
                if isinstance(result, Exception):
                    done.set_exception(result)
                else:
                    done.set_result(result)

    async def _pipeline(self, batch: list[tuple[Any, tuple[Any, ...], Any]]) -> list[Any]:
        """Run the batch's scripts in one pipeline; scripts the server lost (a restart) are
        loaded again and the runs they refused sent once more, in order."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for script, args, _ in batch:
                pipe.evalsha(script.sha, 0, self._prefix, *args)
            results: list[Any] = await pipe.execute(raise_on_error=False)
        refused = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if refused:
            for script in {id(batch[i][0]): batch[i][0] for i in refused}.values():
                script.sha = await self._redis.script_load(script.script)
            again = await self._pipeline([batch[i] for i in refused])
            for i, result in zip(refused, again, strict=True):
                results[i] = result
        return results

    async def add(
        self, worker: str, tier: Tier, keys: Sequence[int], chain: bool = False,
        after: int | None = None,
    ) -> None:
        if keys:
            await self._write(self._add, worker, _INDEX[tier], self.max_entries, _pack(keys))

    async def remove(self, worker: str, tier: Tier | None, keys: Sequence[int]) -> list[bool]:
        if not keys:
            return []
        bits = _ALL_TIERS if tier is None else 1 << _INDEX[tier]
        flags = await self._write(self._remove, worker, bits, _pack(keys))
        return [bool(f) for f in flags]

    async def move(self, worker: str, src: Tier, dst: Tier, keys: Sequence[int]) -> int:
        if not keys:
            return 0
        absent: int = await self._write(self._move, worker, _INDEX[src], _INDEX[dst], _pack(keys))
        return absent

    async def drop_worker(self, worker: str, keys: Iterable[int]) -> None:
        # The worker's own set names its entries, including those other replicas added.
        await self._write(self._drop, worker)

    async def mark(self, worker: str, seq: int, ts: float) -> None:
        if math.isfinite(ts):  # a publisher's clock alone orders marks (the script compares)
            await self._write(self._mark, worker, seq, repr(ts))  # repr: the float read back

    async def marked(self, worker: str) -> tuple[int, float] | None:
        with self._reaching():
            raw = await self._redis.hget(self._prefix + b"m", worker)
        if raw is None:
            return None
        seq, ts = raw.split()
        return int(seq), float(ts)

    async def match(self, keys: Sequence[int], workers: Collection[str]) -> dict[str, WorkerMatch]:
        names = list(dict.fromkeys(workers))
        if not names:
            return {}
        found = await self._run(self._match, _pack(keys), *names)
        out = dict.fromkeys(names, _NONE)
        for j, depth, *per_tier in struct.iter_unpack(">6I", found):
            by_tier = {_TIERS[t]: n for t, n in enumerate(per_tier) if n}
            out[names[j - 1]] = WorkerMatch(depth, by_tier)
        return out

    async def stats(self) -> IndexStats:
        with self._reaching():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self._prefix + b"c")
                pipe.hgetall(self._prefix + b"s")
                counters, slots = await pipe.execute()
        names = {int(slot): name.decode() for name, slot in slots.items()}
        by_worker: Counter[tuple[str, Tier]] = Counter()
        for field, value in counters.items():
            slot, dot, tier = field.partition(b".")
            if dot and int(value):
                by_worker[(names[int(slot)], _TIERS[int(tier)])] = int(value)
        by_tier: Counter[Tier] = Counter()
        for (_, tier), n in by_worker.items():
            by_tier[tier] += n
        return IndexStats(
            int(counters.get(b"n", 0)), int(counters.get(b"x", 0)), by_tier, Counter(), by_worker
        )

    async def close(self) -> None:
        await self._redis.aclose()
