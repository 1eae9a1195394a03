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
`finish` replaces the reservation with the real count (reconciliation). Concurrency:
an in-flight set with a lease expiry, so a crashed replica's slots come back by
themselves.

Exactness across replicas (`RedisLimiter`): check-and-admit for all scopes of a
request runs in **one Lua script**. Redis runs a script atomically (no other command
interleaves), so there is no read-modify-write race between replicas, and time comes
from the Redis server (`TIME`), so replica clock skew cannot stretch a window. All
scopes are checked before any is charged: a request refused by its tenant does not use
up its key's quota. `LocalLimiter` is the same algorithm in one process under a lock.

If Redis fails, `RedisLimiter` raises `LimiterUnavailableError`; the middleware
decides (fail closed: 503; fail open: admit and count the error). A request that ends
while Redis is down keeps its lease in the limiter, which finishes it once Redis answers
again (else its concurrency slot stayed taken for the whole 1 h lease: found by
tests/reliability/test_stores.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.protocol.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)
MAX_UNFINISHED = 100_000  # leases kept for finishing after an outage; the rest expire


class LimiterUnavailableError(ServiceUnavailableError):
    """The shared counter store could not be reached."""


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

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the tightest scope of each kind."""
        return rate_limit_headers(self.scopes, self.states)


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

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def _new_request_id() -> str:
    return uuid.uuid4().hex


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
            if why is not None:
                reason, retry = reason or why, max(retry, r)
        if reason is not None:
            states = tuple(log.state(now, self.window_s) for log in logs)
            return Decision(False, reason, retry, scopes, states)
        rid = _new_request_id()
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
        if scope.rpm is not None and len(log.requests) + 1 > scope.rpm:
            return (log.requests[0] + w - now if log.requests else w), "requests"
        if scope.tpm is not None and need > scope.tpm:
            return w, "too_large"
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

# KEYS: 4 per scope (requests zset, tokens zset, token amounts hash + "__sum", in-flight zset)
# ARGV: rid, need, window, lease, then rpm, tpm, max_concurrent per scope (-1 = unlimited)
# Returns: {allowed, retry_after, reason, then per scope: requests, req_reset, tokens, tok_reset}
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rid, need = ARGV[1], tonumber(ARGV[2])
local window, lease = tonumber(ARGV[3]), tonumber(ARGV[4])
local n = #KEYS / 4
local cutoff = now - window

local function purge(req, tok, amt, conc)
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

local function tokens_retry(tok, amt, used, limit)
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

local reason, retry = '', 0
local counts = {}
for i = 0, n - 1 do
  local req, tok, amt, conc = KEYS[4*i+1], KEYS[4*i+2], KEYS[4*i+3], KEYS[4*i+4]
  local rpm, tpm, maxc = tonumber(ARGV[5+3*i]), tonumber(ARGV[6+3*i]), tonumber(ARGV[7+3*i])
  purge(req, tok, amt, conc)
  local rc = redis.call('ZCARD', req)
  local tu = tonumber(redis.call('HGET', amt, '__sum') or '0')
  local why, r = '', 0
  if rpm >= 0 and rc + 1 > rpm then
    why = 'requests'
    local first = redis.call('ZRANGE', req, 0, 0, 'WITHSCORES')
    r = window
    if #first > 0 then r = tonumber(first[2]) + window - now end
  elseif tpm >= 0 and need > tpm then
    why, r = 'too_large', window
  elseif tpm >= 0 and tu + need > tpm then
    why, r = 'tokens', tokens_retry(tok, amt, tu, tpm)
  elseif maxc >= 0 and redis.call('ZCARD', conc) + 1 > maxc then
    why, r = 'concurrency', 1
  end
  if why ~= '' then
    if reason == '' then reason = why end
    if r > retry then retry = r end
  end
  counts[i] = {rc, tu}
end

local allowed = 0
if reason == '' then
  allowed = 1
  local ttl = math.ceil(window * 1000) + 1000
  for i = 0, n - 1 do
    local req, tok, amt, conc = KEYS[4*i+1], KEYS[4*i+2], KEYS[4*i+3], KEYS[4*i+4]
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

local out = {allowed, tostring(retry), reason}
for i = 0, n - 1 do
  local req, tok = KEYS[4*i+1], KEYS[4*i+2]
  table.insert(out, counts[i][1])
  table.insert(out, tostring(newest(req)))
  table.insert(out, counts[i][2])
  table.insert(out, tostring(newest(tok)))
end
return out
"""

# KEYS: 3 per scope (tokens zset, amounts hash, in-flight zset); ARGV: rid, reserved, actual, window
_FINISH_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rid, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local window = tonumber(ARGV[4])
for i = 0, #KEYS / 3 - 1 do
  local tok, amt, conc = KEYS[3*i+1], KEYS[3*i+2], KEYS[3*i+3]
  redis.call('ZREM', conc, rid)
  local ts = redis.call('ZSCORE', tok, rid)
  local old = redis.call('HGET', amt, rid)
  if ts and old and tonumber(ts) > now - window then
    redis.call('HSET', amt, rid, actual)
    redis.call('HINCRBY', amt, '__sum', actual - tonumber(old))
  elseif actual > reserved then
    local late = rid .. ':late'
    redis.call('ZADD', tok, now, late)
    redis.call('HSET', amt, late, actual - reserved)
    redis.call('HINCRBY', amt, '__sum', actual - reserved)
    redis.call('PEXPIRE', tok, math.ceil(window * 1000) + 1000)
    redis.call('PEXPIRE', amt, math.ceil(window * 1000) + 1000)
  end
end
return 1
"""


def _limit_arg(value: int | None) -> int:
    return -1 if value is None else value


class RedisLimiter(Limiter):
    """The sliding-window log in Redis, shared by every gateway replica.

    Owns one `redis.asyncio.Redis` client (injected or built from `url`). Keys are
    `<prefix><scope>:{req,tok,amt,conc}`; each expires on its own when idle.
    """

    def __init__(self, url: str | None = None, *, client: object | None = None,
                 prefix: str = "sluice:rl:", window_s: float = 60.0,
                 lease_s: float = 3600.0, timeout_s: float = 1.0,
                 retry_interval_s: float = 1.0, max_connections: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as aioredis

        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self.down_since: float | None = None  # set while Redis is failing
        self._unfinished: list[tuple[Lease, int]] = []  # finishes Redis missed (outage)
        self._next_try = 0.0
        self.window_s = window_s
        self.lease_s = lease_s
        self.prefix = prefix
        # A blocking pool: a burst waits for a free connection instead of failing with
        # "Too many connections" (which would read as Redis being down).
        pool = aioredis.BlockingConnectionPool.from_url(
            url or "redis://127.0.0.1:6379/0", max_connections=max_connections, timeout=10,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.client = client or aioredis.Redis.from_pool(pool)
        self._acquire_script = self.client.register_script(_ACQUIRE_LUA)  # type: ignore[attr-defined]
        self._finish_script = self.client.register_script(_FINISH_LUA)  # type: ignore[attr-defined]

    def _keys(self, scope: Scope, kinds: Sequence[str]) -> list[str]:
        return [f"{self.prefix}{scope.name}:{kind}" for kind in kinds]

    async def acquire(self, scopes: Sequence[Scope], tokens: int) -> Decision:
        scopes = tuple(scopes)
        rid = _new_request_id()
        keys = [k for s in scopes for k in self._keys(s, ("req", "tok", "amt", "conc"))]
        args: list[object] = [rid, tokens, self.window_s, self.lease_s]
        for s in scopes:
            args += [_limit_arg(s.rpm), _limit_arg(s.tpm), _limit_arg(s.max_concurrent)]
        try:
            raw = await self._call(self._acquire_script, keys, args)
        except _NotTried:
            raise
        except LimiterUnavailableError:
            # the script may have run before the connection broke, taking a slot nobody
            # will free: finish it once Redis answers (with actual == reserved a finish
            # only removes the slot, if there is one; found by tests/reliability)
            if len(self._unfinished) < MAX_UNFINISHED:
                self._unfinished.append((Lease(rid, scopes, tokens), tokens))
            raise
        if self._unfinished:
            with contextlib.suppress(LimiterUnavailableError):
                await self._finish_unfinished()
        allowed, retry, reason = int(raw[0]), float(raw[1]), _text(raw[2])
        states = tuple(
            ScopeState(int(raw[3 + 4 * i]), float(raw[4 + 4 * i]), int(raw[5 + 4 * i]),
                       float(raw[6 + 4 * i]))
            for i in range(len(scopes)))
        if not allowed:
            return Decision(False, reason, retry, scopes, states)
        return Decision(True, None, 0.0, scopes, states, Lease(rid, scopes, tokens))

    async def finish(self, lease: Lease, actual_tokens: int) -> None:
        """Reconcile tokens and free the slot. If Redis is unreachable the lease is kept
        (up to MAX_UNFINISHED) and finished once Redis answers again, so an outage does
        not hold concurrency slots for the whole lease; the error is still raised."""
        try:
            await self._finish(lease, actual_tokens)
        except LimiterUnavailableError:
            if len(self._unfinished) < MAX_UNFINISHED:
                self._unfinished.append((lease, actual_tokens))
            raise
        if self._unfinished:
            with contextlib.suppress(LimiterUnavailableError):
                await self._finish_unfinished()

    async def _finish(self, lease: Lease, actual_tokens: int) -> None:
        keys = [k for s in lease.scopes for k in self._keys(s, ("tok", "amt", "conc"))]
        args = [lease.request_id, lease.reserved_tokens, actual_tokens, self.window_s]
        await self._call(self._finish_script, keys, args)

    async def _finish_unfinished(self) -> None:
        """Finish the leases an outage left (the finish script is idempotent: a slot is
        removed by id, tokens set to the actual count). The list is taken whole, so
        concurrent callers never finish one lease twice; if Redis fails again, what is
        left goes back and the error is raised."""
        pending, self._unfinished = self._unfinished, []
        for i, (lease, actual_tokens) in enumerate(pending):
            try:
                await self._finish(lease, actual_tokens)
            except LimiterUnavailableError:
                self._unfinished.extend(pending[i:])
                raise

    async def _call(self, script: object, keys: list[str], args: list[object]) -> list[Any]:
        """Run a script; while Redis is down, try it at most once per `retry_interval_s`
        (other calls fail at once instead of each waiting out a connect timeout)."""
        from redis.exceptions import RedisError

        now = self.clock()
        if self.down_since is not None and now < self._next_try:
            raise _NotTried("rate limiter store unreachable (retrying shortly)")
        try:
            result = await script(keys=keys, args=args)  # type: ignore[operator]
        except (RedisError, OSError, TimeoutError) as exc:
            if self.down_since is None:
                self.down_since = now
                logger.error("rate limiter: Redis unreachable: %s", exc)
            self._next_try = now + self.retry_interval_s
            await self._drop_idle_connections()
            raise LimiterUnavailableError(f"rate limiter store unreachable: {exc}") from exc
        if self.down_since is not None:
            logger.warning("rate limiter: Redis back after %.1f s",
                           self.clock() - self.down_since)
            self.down_since = None
        return result  # type: ignore[no-any-return]

    async def _drop_idle_connections(self) -> None:
        """Close the pool's idle connections: they died with Redis (or the network), but
        while it is down calls are gated and never use them, so after the restore each
        would fail one try (a second apart) before being replaced: 503s for seconds
        after Redis was back (found by tests/reliability/test_stores.py)."""
        pool = getattr(self.client, "connection_pool", None)
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.disconnect(inuse_connections=False)

    async def close(self) -> None:
        await self.client.aclose()  # type: ignore[attr-defined]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

