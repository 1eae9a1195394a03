"""Rate limits that hold exactly: requests/min, tokens/min, concurrent requests.

Algorithm: a **sliding-window log**, per scope (a key, a tenant). Every admitted
request leaves an entry (time, request id, tokens) that counts for `window_s` seconds;
a request is admitted iff, for every scope it belongs to, the entries younger than the
window plus this request stay within the limit. Unlike fixed windows (2x bursts at the
boundary) or a token bucket/GCRA (a full bucket plus refill admits up to ~2x the limit
in the first minute), a log gives the strong guarantee: **no 60-second interval ever
holds more than the limit**, and a burst admits exactly the limit. The cost is memory
proportional to the limit per scope, which is small for per-minute limits.

Tokens: a request reserves `prompt_tokens + max_tokens` at admission; when it ends,
`finish` replaces the reservation with the real count (reconciliation). A request whose
reservation alone is over a scope's tokens-per-minute limit can never be admitted: its
reason is `too_large` whatever else also refuses it (`too_large_for` names the limit),
so the gateway can tell the client not to retry. Concurrency:
an in-flight set with a lease expiry, so a crashed replica's slots come back by
themselves.

Exactness across replicas (`RedisLimiter`): check-and-admit for all scopes of a
request runs in **one Lua script**. Redis runs a script atomically (no other command
interleaves), so there is no read-modify-write race between replicas, and time comes
from the Redis server (`TIME`), so replica clock skew cannot stretch a window. All
scopes are checked before any is charged: a request refused by its tenant does not use
up its key's quota. Calls are batched into steps (`redis_steps.py`: one script call
carries every acquire and finish that arrived meanwhile, applied in arrival order), so
a replica pays one round trip per step, not per call. `LocalLimiter` is the same
algorithm in one process under a lock.

If Redis fails, `RedisLimiter` raises `LimiterUnavailableError`; the middleware
decides (fail closed: 503; fail open: admit and count the error). A request that ends
while Redis is down keeps its lease in the limiter, which finishes it once Redis answers
again (else its concurrency slot stayed taken for the whole 1 h lease: found by
tests/reliability/test_stores.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.gateway.redis_steps import RedisSteps
from sluice.protocol.errors import ServiceUnavailableError
from sluice.protocol.ids import unique_hex

logger = logging.getLogger(__name__)
MAX_UNFINISHED = 100_000  # leases kept for finishing after an outage; the rest expire


class LimiterUnavailableError(ServiceUnavailableError):
    """The shared counter store could not be reached (503 `limiter_unavailable`, as the
    database's is `store_unavailable`; its code was null)."""

    default_code = "limiter_unavailable"


class _NotTried(LimiterUnavailableError):
    """Redis is down and this call was not sent (calls are gated between retries)."""


@dataclass(frozen=True)
class Scope:
    """One set of counters and its limits; `None` means unlimited."""

    name: str
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class ScopeState:
    """A scope's counters as seen by this request (after its own admission if admitted)."""

    requests_used: int
    requests_reset_s: float
    tokens_used: int
    tokens_reset_s: float


@dataclass(frozen=True)
class Lease:
    """What `finish` needs to reconcile tokens and free the concurrency slot."""

    request_id: str
    scopes: tuple[Scope, ...]
    reserved_tokens: int


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str | None  # requests | tokens | too_large | concurrency
    retry_after_s: float
    scopes: tuple[Scope, ...]
    states: tuple[ScopeState, ...]
    lease: Lease | None = None
    # the auth version's Redis mirror, read atomically with this decision (RedisLimiter
    # with a mirror key: gateway/auth_mirror.py); None where there is none (or no key)
    auth_version: int | None = None

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tightest scope of each kind."""
        return rate_limit_headers(self.scopes, self.states)


def too_large_for(scopes: Sequence[Scope], tokens: int) -> int | None:
    """The lowest tokens-per-minute limit that `tokens` alone exceed (such a request is
    refused whatever the window holds, now and later), or None."""
    limits = [s.tpm for s in scopes if s.tpm is not None and tokens > s.tpm]
    return min(limits) if limits else None


def format_reset(seconds: float) -> str:
    """OpenAI's duration format: `20ms`, `1s`, `6m0s`."""
    seconds = round(max(0.0, seconds), 3)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_limit_headers(scopes: Sequence[Scope], states: Sequence[ScopeState]) -> dict[str, str]:
    headers: dict[str, str] = {}
    pairs = list(zip(scopes, states, strict=True))
    with_rpm = [(s.rpm, st) for s, st in pairs if s.rpm is not None]
    if with_rpm:
        limit, st = min(with_rpm, key=lambda p: p[0] - p[1].requests_used)
        headers["x-ratelimit-limit-requests"] = str(limit)
        headers["x-ratelimit-remaining-requests"] = str(max(0, limit - st.requests_used))
        headers["x-ratelimit-reset-requests"] = format_reset(st.requests_reset_s)
    with_tpm = [(s.tpm, st) for s, st in pairs if s.tpm is not None]
    if with_tpm:
        limit, st = min(with_tpm, key=lambda p: p[0] - p[1].tokens_used)
        headers["x-ratelimit-limit-tokens"] = str(limit)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limit - st.tokens_used))
        headers["x-ratelimit-reset-tokens"] = format_reset(st.tokens_reset_s)
    return headers


class Limiter(ABC):
    """Contract: `acquire` checks every scope and, only if all admit, charges all of them
    atomically (one request, `tokens` reserved, one concurrency slot). `finish` must be
    called exactly once per admitted lease: it sets the lease's tokens to `actual_tokens`
    and frees the slot. Both may raise `LimiterUnavailableError`."""

    window_s: float

    @abstractmethod
    async def acquire(self, scopes: Sequence[Scope], tokens: int) -> Decision: ...

    @abstractmethod
    async def finish(self, lease: Lease, actual_tokens: int) -> None: ...

    async def give_back(self, lease: Lease) -> None:
        """Undo an admission nothing was sent for (instead of `finish`): frees its slot
        and tokens and, where the limiter can, takes the request off the window's count."""
        await self.finish(lease, 0)

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


# -- in process -----------------------------------------------------------------------


@dataclass
class _Log:
    """One scope's sliding-window log. Every dict is in time order (entries are only
    appended, at the current time), so expiry pops from the front: O(expired). Each
    dict maps strings to plain numbers, so the garbage collector never tracks it: a
    minute's log at 1,000 req/s holds 60,000 entries, and a tracked dict of them (or of
    lists or tuples) is walked by collections that run every few hundred requests."""

    requests: deque[float] = field(default_factory=deque)
    token_ts: dict[str, float] = field(default_factory=dict)  # rid -> when it was counted
    token_amounts: dict[str, int] = field(default_factory=dict)  # rid -> tokens (same keys)
    token_sum: int = 0
    inflight: dict[str, float] = field(default_factory=dict)  # rid -> lease expiry

    def add_tokens(self, rid: str, ts: float, amount: int) -> None:
        self.token_ts[rid] = ts
        self.token_amounts[rid] = amount
        self.token_sum += amount

    def purge(self, now: float, window: float) -> None:
        cutoff = now - window
        while self.requests and self.requests[0] <= cutoff:
            self.requests.popleft()
        while self.token_ts:
            rid, ts = next(iter(self.token_ts.items()))
            if ts > cutoff:
                break
            del self.token_ts[rid]
            self.token_sum -= self.token_amounts.pop(rid)
        while self.inflight:
            rid, expiry = next(iter(self.inflight.items()))
            if expiry > now:
                break
            del self.inflight[rid]

    def state(self, now: float, window: float) -> ScopeState:
        req_reset = self.requests[-1] + window - now if self.requests else 0.0
        tok_reset = next(reversed(self.token_ts.values())) + window - now \
            if self.token_ts else 0.0
        return ScopeState(len(self.requests), req_reset, self.token_sum, tok_reset)

    def tokens_retry(self, need: int, limit: int, now: float, window: float) -> float:
        freed = 0
        for rid, ts in self.token_ts.items():
            freed += self.token_amounts[rid]
            if self.token_sum - freed + need <= limit:
                return ts + window - now
        return window


class LocalLimiter(Limiter):
    """The sliding-window log in this process (one gateway replica). Thread-safe."""

    def __init__(self, window_s: float = 60.0, lease_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.lease_s = lease_s
        self.clock = clock
        self._logs: dict[str, _Log] = {}
        self._lock = threading.Lock()

    async def acquire(self, scopes: Sequence[Scope], tokens: int) -> Decision:
        with self._lock:
            return self._acquire(tuple(scopes), tokens, self.clock())

    def _acquire(self, scopes: tuple[Scope, ...], need: int, now: float) -> Decision:
        logs = [self._log(s.name) for s in scopes]
        for log in logs:
            log.purge(now, self.window_s)
        reason, retry = None, 0.0
        for scope, log in zip(scopes, logs, strict=True):
            r, why = self._check(scope, log, need, now)
            if why is not None:  # too_large wins: no retry can cure it
                reason = why if reason is None or why == "too_large" else reason
                retry = max(retry, r)
        if reason is not None:
            states = tuple(log.state(now, self.window_s) for log in logs)
            return Decision(False, reason, retry, scopes, states)
        rid = unique_hex()
        for log in logs:
            log.requests.append(now)
            log.add_tokens(rid, now, need)
            log.inflight[rid] = now + self.lease_s
        states = tuple(log.state(now, self.window_s) for log in logs)
        return Decision(True, None, 0.0, scopes, states, Lease(rid, scopes, need))

    def _log(self, name: str) -> _Log:
        log = self._logs.get(name)
        if log is None:
            log = self._logs[name] = _Log()
        return log

    def _check(self, scope: Scope, log: _Log, need: int, now: float) -> tuple[float, str | None]:
        w = self.window_s
        if scope.tpm is not None and need > scope.tpm:
            return w, "too_large"
        if scope.rpm is not None and len(log.requests) + 1 > scope.rpm:
            return (log.requests[0] + w - now if log.requests else w), "requests"
        if scope.tpm is not None and log.token_sum + need > scope.tpm:
            return log.tokens_retry(need, scope.tpm, now, w), "tokens"
        if scope.max_concurrent is not None and len(log.inflight) + 1 > scope.max_concurrent:
            return 1.0, "concurrency"
        return 0.0, None

    async def finish(self, lease: Lease, actual_tokens: int) -> None:
        with self._lock:
            now = self.clock()
            for scope in lease.scopes:
                log = self._log(scope.name)
                log.inflight.pop(lease.request_id, None)
                self._reconcile(log, lease, actual_tokens, now)

    def _reconcile(self, log: _Log, lease: Lease, actual: int, now: float) -> None:
        ts = log.token_ts.get(lease.request_id)
        if ts is not None and ts > now - self.window_s:
            log.token_sum += actual - log.token_amounts[lease.request_id]
            log.token_amounts[lease.request_id] = actual
        elif actual > lease.reserved_tokens:  # reservation already left the window
            log.add_tokens(f"{lease.request_id}:late", now, actual - lease.reserved_tokens)


# -- shared through Redis ---------------------------------------------------------------

# One step (redis_steps.py): ARGV[1] is JSON {prefix, window, lease, ops}; ops run in
# order, all at one `now`:
#   ["a", rid, need, [[scope, rpm, tpm, max_concurrent], ...]]   (-1 = unlimited)
#       -> [allowed, retry_after, reason, [requests, req_reset, tokens, tok_reset] per scope]
#   ["f", rid, reserved, actual, [scope, ...]]                    -> 1
#   ["r", [[rid, [scope, ...]], ...]]   (each live slot's lease: now + lease)  -> 1
# Keys per scope: <prefix><scope>:req (zset), :tok (zset), :amt (hash + "__sum"), :conc
# (zset of lease expiries). They are named in the JSON, not KEYS: a step touches the
# scopes of many requests (one Redis, not a cluster; the old per-call script's keys
# spanned slots too).
_STEP_LUA = """
local step = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window, lease, prefix = step.window, step.lease, step.prefix
local cutoff = now - window
local ttl = math.ceil(window * 1000) + 1000
local purged = {}
-- the auth version's mirror (gateway/auth_mirror.py), once per step; -1: no key
local auth = -1
if step.mirror then auth = tonumber(redis.call('GET', step.mirror) or '-1') end

local function keys(scope)
  local p = prefix .. scope
  return p .. ':req', p .. ':tok', p .. ':amt', p .. ':conc'
end

local function purge(scope)
  if purged[scope] then return end  -- one `now` per step: once is enough
  purged[scope] = true
  local req, tok, amt, conc = keys(scope)
  redis.call('ZREMRANGEBYSCORE', req, '-inf', cutoff)
  while true do
    local old = redis.call('ZRANGEBYSCORE', tok, '-inf', cutoff, 'LIMIT', 0, 500)
    if #old == 0 then break end
    local vals = redis.call('HMGET', amt, unpack(old))
    local s = 0
    for _, v in ipairs(vals) do s = s + (tonumber(v) or 0) end
    redis.call('HINCRBY', amt, '__sum', -s)
    redis.call('HDEL', amt, unpack(old))
    redis.call('ZREM', tok, unpack(old))
  end
  redis.call('ZREMRANGEBYSCORE', conc, '-inf', now)
end

local function tokens_retry(tok, amt, used, need, limit)
  -- bounded scan (only on refusal): past 2000 entries, answer the full window
  local entries = redis.call('ZRANGE', tok, 0, 1999, 'WITHSCORES')
  local freed = 0
  for i = 1, #entries, 2 do
    freed = freed + (tonumber(redis.call('HGET', amt, entries[i])) or 0)
    if used - freed + need <= limit then return tonumber(entries[i + 1]) + window - now end
  end
  return window
end

local function newest(z)
  local last = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
  if #last == 0 then return 0 end
  return tonumber(last[2]) + window - now
end

local function acquire(rid, need, scopes)
  local reason, retry, counts = '', 0, {}
  for i, s in ipairs(scopes) do
    local req, tok, amt, conc = keys(s[1])
    local rpm, tpm, maxc = s[2], s[3], s[4]
    purge(s[1])
    local rc = redis.call('ZCARD', req)
    local tu = tonumber(redis.call('HGET', amt, '__sum') or '0')
    local why, r = '', 0
    if tpm >= 0 and need > tpm then
      why, r = 'too_large', window
    elseif rpm >= 0 and rc + 1 > rpm then
      why = 'requests'
      local first = redis.call('ZRANGE', req, 0, 0, 'WITHSCORES')
      r = window
      if #first > 0 then r = tonumber(first[2]) + window - now end
    elseif tpm >= 0 and tu + need > tpm then
      why, r = 'tokens', tokens_retry(tok, amt, tu, need, tpm)
    elseif maxc >= 0 and redis.call('ZCARD', conc) + 1 > maxc then
      why, r = 'concurrency', 1
    end
    if why ~= '' then
      if reason == '' or why == 'too_large' then reason = why end  -- no retry cures it
      if r > retry then retry = r end
    end
    counts[i] = {rc, tu}
  end
  local allowed = 0
  if reason == '' then
    allowed = 1
    for i, s in ipairs(scopes) do
      local req, tok, amt, conc = keys(s[1])
      redis.call('ZADD', req, now, rid)
      redis.call('ZADD', tok, now, rid)
      redis.call('HSET', amt, rid, need)
      redis.call('HINCRBY', amt, '__sum', need)
      redis.call('ZADD', conc, now + lease, rid)
      redis.call('PEXPIRE', req, ttl)
      redis.call('PEXPIRE', tok, ttl)
      redis.call('PEXPIRE', amt, ttl)
      redis.call('PEXPIRE', conc, math.ceil(lease * 1000))
      counts[i] = {counts[i][1] + 1, counts[i][2] + need}
    end
  end
  local states = {}
  for i, s in ipairs(scopes) do
    local req, tok = keys(s[1])
    states[i] = {counts[i][1], newest(req), counts[i][2], newest(tok)}
  end
  return {allowed, retry, reason, states, auth}
end

local function finish(rid, reserved, actual, scopes, undo)
  for _, scope in ipairs(scopes) do
    local req, tok, amt, conc = keys(scope)
    redis.call('ZREM', conc, rid)
    if undo then redis.call('ZREM', req, rid) end  -- given back: not a request at all
    local ts = redis.call('ZSCORE', tok, rid)
    local old = redis.call('HGET', amt, rid)
    if ts and old and tonumber(ts) > cutoff then
      redis.call('HSET', amt, rid, actual)
      redis.call('HINCRBY', amt, '__sum', actual - tonumber(old))
    elseif actual > reserved then
      local late = rid .. ':late'
      redis.call('ZADD', tok, now, late)
      redis.call('HSET', amt, late, actual - reserved)
      redis.call('HINCRBY', amt, '__sum', actual - reserved)
      redis.call('PEXPIRE', tok, ttl)
      redis.call('PEXPIRE', amt, ttl)
    end
  end
  return 1
end

local function renew(leases)
  -- only live slots are sent (a finish is sent after its slot left the list), so a
  -- slot lost meanwhile (an outage past the lease, a Redis restart) is taken again
  for _, l in ipairs(leases) do
    for _, scope in ipairs(l[2]) do
      local req, tok, amt, conc = keys(scope)
      redis.call('ZADD', conc, now + lease, l[1])
      redis.call('PEXPIRE', conc, math.ceil(lease * 1000))
    end
  end
  return 1
end

local out = {}
for i, op in ipairs(step.ops) do
  if op[1] == 'a' then
    out[i] = acquire(op[2], op[3], op[4])
  elseif op[1] == 'r' then
    out[i] = renew(op[2])
  else
    out[i] = finish(op[2], op[3], op[4], op[5], op[6])
  end
end
return cjson.encode(out)
"""


def _limit_arg(value: int | None) -> int:
    return -1 if value is None else value


class RedisLimiter(Limiter):
    """The sliding-window log in Redis, shared by every gateway replica.

    Calls go to Redis in steps (`redis_steps.RedisSteps`: one script call carries every
    acquire and finish that arrived meanwhile, on one connection, at most two steps in
    flight); each call is still checked atomically, in arrival order. Keys are
    `<prefix><scope>:{req,tok,amt,conc}`; each expires on its own when idle.

    A caller cancelled while its acquire is in flight (client gone, shutdown) does not
    keep the slot it may have been given: the step still runs, and if it admitted the
    request the limiter finishes the lease itself (tokens as reserved).

    A concurrency slot is a lease of `lease_s` (60 s) that this replica renews every
    third of it, in one op for all its requests in flight (`_live`), until each one
    finishes: a replica that dies without finishing them (kill -9, the OOM killer)
    holds their slots one lease at most. The lease was an hour, never renewed, so that
    no request outlived it, and a `max_concurrent: 1` key was refused for that hour.
    """

    def __init__(self, url: str | None = None, *, prefix: str = "sluice:rl:",
                 window_s: float = 60.0, lease_s: float = 60.0, timeout_s: float = 1.0,
                 retry_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as aioredis

        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self.down_since: float | None = None  # set while Redis is failing
        self._unfinished: list[tuple[Lease, int]] = []  # finishes Redis missed (outage)
        self._live: dict[str, Lease] = {}  # admitted here, not finished: slots to renew
        self._renewer: asyncio.Task[None] | None = None
        self._next_try = 0.0
        self.window_s = window_s
        self.lease_s = lease_s
        self.prefix = prefix
        self.url = url or "redis://127.0.0.1:6379/0"
        pool = aioredis.ConnectionPool.from_url(
            self.url, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s)
        self.steps = RedisSteps(pool, _STEP_LUA,
                                {"prefix": prefix, "window": window_s, "lease": lease_s},
                                on_step=self._after_step, error=_unavailable)

    def mirror_auth_version(self, key: str) -> None:
        """Read the auth version's mirror at `key` in every admission's step (returned as
        `Decision.auth_version`)."""
        self.steps.header["mirror"] = key

    async def acquire(self, scopes: Sequence[Scope], tokens: int) -> Decision:
        scopes = tuple(scopes)
        lease = Lease(unique_hex(), scopes, tokens)
        limits = [[s.name, _limit_arg(s.rpm), _limit_arg(s.tpm), _limit_arg(s.max_concurrent)]
                  for s in scopes]
        # between retries while Redis is down this raises _NotTried: nothing sent, nothing kept
        future = self._submit(["a", lease.request_id, tokens, limits])
        try:
            answer = await asyncio.shield(future)
        except asyncio.CancelledError:
            # the step runs without its caller: give back what it may admit
            future.add_done_callback(lambda done: self._abandoned(lease, done))
            raise
        except LimiterUnavailableError:
            # the step may have run before the connection broke, taking a slot nobody
            # will free: finish it once Redis answers (with actual == reserved a finish
            # only removes the slot, if there is one; found by tests/reliability)
            self._keep(lease, tokens)
            raise
        self._finish_unfinished()
        allowed, retry, reason, states, auth = answer
        decided = tuple(ScopeState(int(st[0]), float(st[1]), int(st[2]), float(st[3]))
                        for st in states)
        version = None if auth < 0 else int(auth)
        if not allowed:
            return Decision(False, reason, float(retry), scopes, decided, auth_version=version)
        self._live[lease.request_id] = lease
        self._renew_soon()
        return Decision(True, None, 0.0, scopes, decided, lease, version)

    def _renew_soon(self) -> None:
        """Start the renewing task on this loop if it is not running."""
        loop = asyncio.get_running_loop()
        task = self._renewer
        if task is None or task.done() or task.get_loop() is not loop:
            self._renewer = loop.create_task(self._renew())

    async def _renew(self) -> None:
        """Every third of the lease, push the expiry of each live slot a lease ahead (one
        op per 500 slots; the ids and scopes are read and submitted in one turn of the
        loop, so no slot finished meanwhile is taken again). A failed renewal (Redis
        down) is tried at the next turn, and retakes a slot that an outage past the
        lease, or a Redis restart, let go."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            live = [[rid, [s.name for s in lease.scopes]] for rid, lease in self._live.items()]
            futures = []
            for i in range(0, len(live), 500):
                try:
                    futures.append(self._submit(["r", live[i:i + 500]]))
                except LimiterUnavailableError:
                    break
            await asyncio.gather(*futures, return_exceptions=True)

    def _abandoned(self, lease: Lease, done: asyncio.Future[Any]) -> None:
        """An acquire whose caller left: free the slot if the step admitted it (or may
        have: the step failed)."""
        if done.cancelled():
            return
        if done.exception() is not None:
            self._keep(lease, lease.reserved_tokens)
        elif done.result()[0]:
            self._finish_later(lease, lease.reserved_tokens)

    async def finish(self, lease: Lease, actual_tokens: int) -> None:
        """Reconcile tokens and free the slot. If Redis is unreachable the lease is kept
        (up to MAX_UNFINISHED) and finished once Redis answers again, so an outage does
        not hold concurrency slots for the whole lease; the error is still raised. The
        finish is applied even if the caller is cancelled meanwhile."""
        await self._end(lease, actual_tokens)

    async def give_back(self, lease: Lease) -> None:
        """`finish` with no tokens that also takes the request off each scope's request
        log (the window's count), in the same step."""
        await self._end(lease, 0, undo=True)

    async def _end(self, lease: Lease, actual_tokens: int, undo: bool = False) -> None:
        self._live.pop(lease.request_id, None)
        try:
            future = self._finish_later(lease, actual_tokens, undo)
        except LimiterUnavailableError:
            self._keep(lease, actual_tokens)
            raise
        await asyncio.shield(future)
        self._finish_unfinished()

    def _finish_later(self, lease: Lease, actual_tokens: int,
                      undo: bool = False) -> asyncio.Future[Any]:
        """Submit the finish; if its step fails, the lease is kept for after the outage."""
        op = ["f", lease.request_id, lease.reserved_tokens, actual_tokens,
              [s.name for s in lease.scopes]]
        future = self._submit(op + [True] if undo else op)
        future.add_done_callback(lambda done: self._kept_if_failed(lease, actual_tokens, done))
        return future

    def _kept_if_failed(self, lease: Lease, actual_tokens: int,
                        done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is not None:
            self._keep(lease, actual_tokens)

    def _keep(self, lease: Lease, actual_tokens: int) -> None:
        if len(self._unfinished) < MAX_UNFINISHED:
            self._unfinished.append((lease, actual_tokens))

    def _finish_unfinished(self) -> None:
        """Finish the leases an outage left (the finish is idempotent: a slot is removed
        by id, tokens set to the actual count); they join the next step. The list is
        taken whole, so no lease is finished twice; one whose step fails is kept again."""
        if not self._unfinished:
            return
        pending, self._unfinished = self._unfinished, []
        for i, (lease, actual_tokens) in enumerate(pending):
            try:
                self._finish_later(lease, actual_tokens)
            except LimiterUnavailableError:
                self._unfinished.extend(pending[i:])
                return

    def _submit(self, op: list[Any]) -> asyncio.Future[Any]:
        """Queue one op for the next step; while Redis is down, let ops through at most
        once per `retry_interval_s` (others fail at once instead of each waiting out a
        connect timeout). The future fails with `LimiterUnavailableError`."""
        if self.down_since is not None and self.clock() < self._next_try:
            raise _NotTried("rate limiter store unreachable (retrying shortly)")
        if self.down_since is not None:
            self._next_try = self.clock() + self.retry_interval_s  # this one is the try
        return self.steps.submit(op)

    def _after_step(self, error: BaseException | None) -> None:
        now = self.clock()
        if error is not None:
            if self.down_since is None:
                self.down_since = now
                logger.error("rate limiter: Redis unreachable: %s", error)
            self._next_try = now + self.retry_interval_s
        elif self.down_since is not None:
            logger.warning("rate limiter: Redis back after %.1f s", now - self.down_since)
            self.down_since = None

    async def close(self) -> None:
        task, self._renewer = self._renewer, None
        if task is not None and not task.done():
            task.cancel()
            if task.get_loop() is asyncio.get_running_loop():
                await asyncio.gather(task, return_exceptions=True)
        await self.steps.close()


def _unavailable(exc: BaseException) -> Exception:
    return LimiterUnavailableError(f"rate limiter store unreachable: {exc}")
