"""Forward one request to a worker and hand its response back as a `Relay`, unbuffered.

    for each attempt (1 + max_retries, each on a worker not yet tried, whose breaker
    is not open; a retry waits its backoff and needs the pool's retry budget):
        decide -> dispatch -> send, read the head and the first body bytes
        connect error / read error / 5xx before the first bytes -> count, retry elsewhere
    Relay: status, headers, the first bytes, then `read()` for the rest as it arrives;
    `close()` (always, however the relay ends) gives the connection back if the body was
    read to its end, otherwise closes it (so the worker sees the disconnect and aborts),
    and stops counting the request in flight.

Nothing reaches the client before the first bytes have arrived, so every retry is
invisible to it. Passive health lives here: each failure counts toward the worker's
circuit breaker (router/breaker.py), or, with breakers off, toward its ejection. The
front ends (server.py, app.py) only write a Relay out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable

from sluice.protocol.errors import ServiceUnavailableError
from sluice.router.breaker import Breakers
from sluice.router.endpoints import Endpoint, Ticket
from sluice.router.metrics import RouterMetrics
from sluice.router.parse import ParsedRequest
from sluice.router.policies import RequestMeta
from sluice.router.pool import Decision, Pool
from sluice.router.upstream import Target, UpstreamConnection, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
RESPONSE_DROP = HOP_BY_HOP - {"content-length"} | {"server", "date"}
_HOP_BY_HOP_B = frozenset(h.encode() for h in HOP_BY_HOP)
_RESPONSE_DROP_B = frozenset(h.encode() for h in RESPONSE_DROP)
_CHUNKED_DROP_B = _RESPONSE_DROP_B | {b"content-length"}


class RetryableError(Exception):
    """The attempt failed before any byte reached the client.

    `counts`: whether it counts toward ejecting the worker (a 503 is a busy worker
    shedding load, not a broken one: retried elsewhere, never ejected for it).
    """

    def __init__(self, message: str, counts: bool = True, answered: bool = False) -> None:
        super().__init__(message)
        self.counts = counts
        self.answered = answered  # the worker answered (an error status): it is up


class WorkersFailed(ServiceUnavailableError):
    """The 503 of a request that no attempt could serve (every worker tried answered 5xx,
    or none was reached). The router may still serve it otherwise (a P/D fallback, a
    canary's baseline), so, like every answer, it is counted in
    `sluice_router_requests_total` where it reaches the client (routed.py), once."""

    def __init__(self, message: str, model: str) -> None:
        super().__init__(message, code="no_healthy_worker")
        self.model = model


class NoWorkerReached(WorkersFailed):
    """No worker answered at all (none available, or every one unreachable: a worker that
    just died looks ready until the probes eject it): the router may hold the request
    for a replacement (`RequestBuffer.hold`)."""


def forward_block(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The client's end-to-end headers (lower-case names), encoded for the worker."""
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers
                    if name not in _HOP_BY_HOP_B)


class Relay:
    """A worker's response on its way to the client: head and first bytes in hand.

    `headers` are the worker's minus hop-by-hop ones, its Content-Length kept when it
    sized the body (`length`; the client gets the same), else `length` is None: the
    front end streams the body (chunked).
    """

    __slots__ = ("status", "headers", "length", "first", "upstream", "ticket", "on_close",
                 "retries", "chunks", "migrations")

    def __init__(self, upstream: UpstreamConnection, first: bytes, ticket: Ticket) -> None:
        self.status = upstream.status
        self.length = upstream.content_length
        drop = _RESPONSE_DROP_B if self.length is not None else _CHUNKED_DROP_B
        self.headers = [(n, v) for n, v in upstream.headers if n not in drop]
        self.first = first
        self.upstream = upstream
        self.ticket = ticket
        self.on_close: Callable[[Relay], None] | None = None  # e.g. ends the router's span
        self.retries = 0  # attempts that failed on other workers before this one
        self.chunks = 0  # body reads after `first` that returned bytes (release.py: TPOT)
        self.migrations = 0  # workers that failed mid-stream and were replaced (migrate.py)

    @property
    def complete(self) -> bool:
        """The whole body has arrived (it is all in `first`, or was read)."""
        return self.upstream.finished

    async def read(self) -> bytes:
        """More body bytes as they arrive; b"" at the end. Raises UpstreamError mid-stream."""
        data = await self.upstream.read()
        self.chunks += bool(data)
        return data

    def close(self) -> None:
        """Give back or close the worker connection; stop counting the request. Idempotent.
        `on_close(relay)` runs first: it may read how the response ended (`complete`)."""
        on_close, self.on_close = self.on_close, None
        try:
            if on_close is not None:
                on_close(self)
        finally:
            self.upstream.release()
            self.ticket.endpoint.finish(self.ticket)


class Proxy:
    """Sends requests for a router; holds its connection pool and retry/ejection settings."""

    def __init__(self, upstream: UpstreamPool, metrics: RouterMetrics, max_retries: int,
                 eject_after_failures: int, breakers: Breakers) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.max_retries = max_retries
        self.eject_after = eject_after_failures
        self.breakers = breakers
        self._targets: dict[str, Target] = {}

    def _target(self, endpoint: Endpoint) -> Target:
        target = self._targets.get(endpoint.url)
        if target is None:
            target = self._targets[endpoint.url] = Target.of(endpoint.url)
        return target

    def cut_stalled(self, endpoint: Endpoint, silent_s: float) -> int:
        """Cut the requests on `endpoint` (a hung worker, monitor.py) that have received
        nothing for `silent_s`: each read fails as if the connection had dropped, so a
        stream migrates (migrate.py) or ends with an error event, and a request before its
        first byte is retried elsewhere. Returns how many (the P/D proxy's requests share
        the connection pool, so they are cut too)."""
        reason = f"the worker answered nothing for {silent_s:g} s and its probes time out"
        cut = self.upstream.cut_silent(self._target(endpoint).key, silent_s, reason)
        if cut:
            log.warning("cut %d request(s) silent for %g s on hung worker %s", cut, silent_s,
                        endpoint.url)
        return cut

    def forget(self, url: str) -> None:
        """A worker left its pool: drop its target and close its idle connections (with
        workers found by DNS, pods come and go for the router's whole life)."""
        target = self._targets.pop(url, None)
        if target is not None:
            self.upstream.forget(target.key)

    async def forward(self, pool: Pool, req: ParsedRequest, meta: RequestMeta, path: bytes,
                      headers: bytes, exclude: Iterable[str] = ()) -> Relay:
        """Send `req` (its raw body, `headers` already encoded by `forward_block`) to
        `path` on the best worker but those in `exclude` (URLs), retrying elsewhere before
        the first byte. Raises WorkersFailed (503) when no attempt succeeds. Counts no
        request and times no first byte: one client request may take several forwards (a
        P/D prefill, a resume after a mid-stream failure, a canary's fallback), and
        routed.py counts and times its answer."""
        tried: list[str] = list(exclude)
        last_error = "no worker is available"
        answered = False
        policy = pool.policy.name
        budget = self.breakers.budget(pool)
        budget.request()
        for attempt in range(self.max_retries + 1):
            if attempt:  # --- flow: retry budget and backoff (router/breaker.py)
                if not budget.take_retry():
                    self.metrics.retry_budget_exhausted.labels(req.model).inc()
                    last_error += "; retry budget exhausted"
                    break
                await asyncio.sleep(self.breakers.backoff(attempt))
            decision = self._decide(pool, meta, tried)
            if decision is None:
                break
            endpoint = decision.endpoint
            ticket = pool.dispatch(meta, decision)
            self.breakers.attempt(endpoint.url)
            self.metrics.prefix_hit_tokens_for(policy).inc(
                min(meta.num_prompt_tokens, decision.choice.cached_blocks * meta.block_size))
            try:
                upstream, first = await self._open(endpoint, pool, req, path, headers)
            except RetryableError as exc:
                endpoint.finish(ticket)
                self._failed(pool, endpoint, exc)
                tried.append(endpoint.url)
                last_error = f"{endpoint.url}: {exc}"
                answered = answered or exc.answered
                continue
            except BaseException:  # cancelled: the client went away before the first byte
                endpoint.finish(ticket)
                self.breakers.abandon(endpoint.url)
                raise
            endpoint.consecutive_failures = 0
            self.breakers.success(endpoint.url)
            endpoint.on_first_byte(ticket, learn=req.stream)
            relay = Relay(upstream, first, ticket)
            relay.retries = len(tried)  # (a migration's excluded workers included)
            return relay
        message = f"no healthy worker could serve model {req.model!r} ({last_error})"
        if not answered:
            raise NoWorkerReached(message, req.model)
        raise WorkersFailed(message, req.model)

    def choose(self, pool: Pool, meta: RequestMeta, tried: Iterable[str] = ()
               ) -> Decision | None:
        """The pool's policy's worker for `meta`, past open breakers and `tried`."""
        skip = self.breakers.blocked(pool)
        skip.update(tried)
        return pool.decide(meta, skip)

    def _decide(self, pool: Pool, meta: RequestMeta, tried: list[str]) -> Decision | None:
        """`choose`, timed and counted per policy."""
        start = time.perf_counter()
        decision = self.choose(pool, meta, tried)
        policy = pool.policy.name
        self.metrics.decision_seconds_for(policy).observe(time.perf_counter() - start)
        if decision is not None:
            self.metrics.decisions_for(policy, decision.endpoint.url).inc()
            self.metrics.prompt_tokens_for(policy).inc(meta.num_prompt_tokens)
        return decision

    def _failed(self, pool: Pool, endpoint: Endpoint, exc: RetryableError) -> None:
        self.metrics.retries.labels(endpoint.url, str(exc).split(":")[0]).inc()
        if not exc.counts:
            if self.breakers.enabled:
                self.breakers.abandon(endpoint.url)
            return
        self.count_failure(pool, endpoint)

    def count_failure(self, pool: Pool, endpoint: Endpoint) -> None:
        """A request failed on `endpoint` (before its first byte or mid-stream): toward
        its circuit breaker, or with breakers off toward its ejection."""
        if self.breakers.enabled:
            self.breakers.failure(pool, endpoint.url)
        elif endpoint.record_failure(self.eject_after):
            self.metrics.ejections.labels(endpoint.url).inc()
            log.warning("ejected %s after %d failures", endpoint.url, endpoint.consecutive_failures)

    def _body(self, pool: Pool, req: ParsedRequest, endpoint: Endpoint) -> bytes:
        model = pool.upstream_model(req.model, endpoint)
        if model == req.model:
            return req.raw
        return json.dumps({**req.body, "model": model}).encode()

    async def _open(self, endpoint: Endpoint, pool: Pool, req: ParsedRequest, path: bytes,
                    headers: bytes) -> tuple[UpstreamConnection, bytes]:
        """Send and wait for the first body bytes; raise RetryableError on failure before."""
        body = self._body(pool, req, endpoint)
        target = self._target(endpoint)
        payload = b"".join((b"POST ", target.prefix, path, b" HTTP/1.1\r\n", target.host_line,
                            headers, b"Content-Length: %d\r\n\r\n" % len(body), body))
        try:
            upstream = await self.upstream.send(target, payload)
        except UpstreamError as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        try:
            if upstream.status >= 500:
                raise RetryableError(f"status {upstream.status}", counts=upstream.status != 503,
                                     answered=True)
            first = await upstream.read()
        except RetryableError:
            upstream.close()
            raise
        except UpstreamError as exc:
            upstream.close()
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled: hang up so the worker aborts
            upstream.close()
            raise
        return upstream, first
