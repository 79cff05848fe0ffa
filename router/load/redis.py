"""`RedisLedger`: router replicas' bookings shared on the index's Redis / Valkey server.

Each replica publishes its own per-worker figures (in-flight requests, their tokens, pending
prefill tokens) as absolute values, and placement adds up the other replicas' figures for its
candidates in one script run, overlapped with the index match. Absolute values, sent by one
task in order, never drift: a lost write is repaired by the next one for that worker, and a
heartbeat rewrites them all every `ttl_s / 3`.

Data model (P = the deployment's prefix, the index's; R = a replica's id, random per process):

    P r     set     the replicas that published figures (members R).
    P g R   hash    worker name -> "in_flight tokens pending_prefill" for replica R; fields of
                    idle workers are deleted. The key expires `ttl_s` after R's last write, so
                    a replica that died (killed, partitioned) stops counting within `ttl_s`:
                    one expiry per replica rather than per booking, renewed by its heartbeat.

A read drops from `P r` the replicas whose hash is gone; a write adds its replica again. A
call the server cannot answer is counted in the index's `StoreOutage` (`load_read`,
`load_publish`) and placement goes on with this replica's own figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import struct
import uuid
from collections.abc import Callable, Iterable, Sequence

import redis
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from router.index import StoreOutage, StoreUnavailable, shown_url
from router.load.ledger import LoadLedger
from router.strategies import WorkerLoad

_log = logging.getLogger("warply.router")
_ERRORS = (redis.ConnectionError, redis.TimeoutError)

_PUBLISH = """
local P, me = ARGV[1], ARGV[2]
local H = P .. 'g' .. me
if ARGV[4] == '1' then redis.call('DEL', H) end
local set, gone = {}, {}
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] == '' then gone[#gone + 1] = ARGV[i]
  else set[#set + 1] = ARGV[i]; set[#set + 1] = ARGV[i + 1] end
end
for i = 1, #gone, 4000 do redis.call('HDEL', H, unpack(gone, i, math.min(i + 3999, #gone))) end
for i = 1, #set, 4000 do redis.call('HSET', H, unpack(set, i, math.min(i + 3999, #set))) end
if redis.call('PEXPIRE', H, ARGV[3]) == 1 then redis.call('SADD', P .. 'r', me) end
return 0
"""

_READ = """
local P, me, m = ARGV[1], ARGV[2], #ARGV - 2
local sum = {}
for j = 1, 3 * m do sum[j] = 0 end
for _, r in ipairs(redis.call('SMEMBERS', P .. 'r')) do
  if r ~= me then
    local H = P .. 'g' .. r
    if redis.call('EXISTS', H) == 0 then
      redis.call('SREM', P .. 'r', r)  -- expired, or nothing booked
    else
      for i = 1, m, 4000 do
        local vals = redis.call('HMGET', H, unpack(ARGV, 2 + i, 2 + math.min(i + 3999, m)))
        for q = 1, #vals do
          if vals[q] then
            local j = 3 * (i + q - 2)
            local a, b, c = string.match(vals[q], '^(%-?%d+) (%-?%d+) (%-?%d+)$')
            sum[j + 1] = sum[j + 1] + tonumber(a)
            sum[j + 2] = sum[j + 2] + tonumber(b)
            sum[j + 3] = sum[j + 3] + tonumber(c)
          end
        end
      end
    end
  end
end
-- One string: (worker number, its three sums) as 32-bit big-endian integers for the workers
-- with something booked (a long array reply is slower to parse than the script runs).
local out = {}
for j = 1, m do
  local b = 3 * j - 2
  if sum[b] ~= 0 or sum[b + 2] ~= 0 then
    out[#out + 1] = struct.pack('>I4i4i4i4', j, sum[b], sum[b + 1], sum[b + 2])
  end
end
return table.concat(out)
"""


def _figures(load: WorkerLoad) -> str:
    """What a replica publishes for one worker ("" when it has nothing booked there)."""
    if not (load.in_flight or load.pending_prefill_tokens):
        return ""
    return f"{load.in_flight} {load.in_flight_tokens} {load.pending_prefill_tokens}"


class RedisLedger(LoadLedger):
    """Bookings shared between a deployment's replicas; see the module docstring."""

    shared = True

    def __init__(
        self,
        url: str,
        prefix: str,
        ttl_s: float,
        timeout_s: float,
        outage: StoreOutage,
        replica: str | None = None,
    ) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.replica = replica or uuid.uuid4().hex[:12]
        """This router's id in the store (random per process: a restart is a new replica)."""
        self._outage = outage
        self._prefix = f"{{{prefix}}}:".encode()  # the index's hash tag: same cluster slot
        self._redis = redis.asyncio.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._publish = self._redis.register_script(_PUBLISH)
        self._read = self._redis.register_script(_READ)
        self._dirty: dict[str, WorkerLoad] = {}
        """Workers whose figures changed since the last write (the latest load object)."""
        self._full = False
        """The next write replaces every figure (heartbeat, or after a failed write)."""
        self._sender: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._every: Callable[[], Iterable[WorkerLoad]] = lambda: ()

    async def loads(self, local: Sequence[WorkerLoad]) -> Sequence[WorkerLoad]:
        try:
            found = await self._read(args=[self._prefix, self.replica, *(w.name for w in local)])
        except _ERRORS as exc:
            self._outage.failed("load_read", self._unavailable(exc))
            return local
        self._outage.recovered()
        out = list(local)
        for j, n, tokens, prefill in struct.iter_unpack(">Iiii", found):
            load = local[j - 1]
            out[j - 1] = dataclasses.replace(
                load,
                in_flight=load.in_flight + n,
                in_flight_tokens=load.in_flight_tokens + tokens,
                pending_prefill_tokens=load.pending_prefill_tokens + prefill,
            )
        return out

    def changed(self, load: WorkerLoad) -> None:
        self._dirty[load.name] = load
        self._kick()

    def _kick(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send())

    def start(self, every: Callable[[], Iterable[WorkerLoad]]) -> None:
        self._every = every
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        _log.info("sharing bookings on %s as replica %s", shown_url(self.url), self.replica)

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        """`exc`, a failure to reach the server, as the outage counter logs it (no password
        shown)."""
        return StoreUnavailable(f"load ledger {shown_url(self.url)}: {exc}")

    async def _heartbeat(self) -> None:
        """Rewrite every figure each third of the ttl: renews the expiry, repairs failed writes."""
        while True:
            self._full = True
            self._kick()
            await asyncio.sleep(self.ttl_s / 3)

    async def _send(self) -> None:
        """Write the changed figures (all of them after a heartbeat or a failure), one script
        run at a time, until none is left."""
        while self._dirty or self._full:
            batch, self._dirty = self._dirty, {}
            full, self._full = self._full, False
            if full:
                batch = {load.name: load for load in self._every()}
            args: list[str | bytes | int] = [
                self._prefix, self.replica, max(1, int(self.ttl_s * 1000)), int(full)
            ]
            for name, load in batch.items():
                args += (name, _figures(load))
            try:
                await self._publish(args=args)
            except _ERRORS as exc:
                self._outage.failed("load_publish", self._unavailable(exc))
                self._dirty.clear()
                self._full = True  # the next write, whenever it comes, rewrites every figure
                return
            else:
                self._outage.recovered()

    async def flush(self) -> None:
        if self._sender is not None:
            await asyncio.shield(self._sender)

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            await asyncio.gather(self._beat, return_exceptions=True)
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        with contextlib.suppress(*_ERRORS):
            await self._redis.delete(self._prefix + b"g" + self.replica.encode())
        await self._redis.aclose()
