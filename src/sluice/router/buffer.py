"""Hold requests for a pool that has no ready worker, until one is ready (scale from zero).

    route -> buffer.admit(pool)
               a worker is available          -> go on at once (one scan of the pool)
               buffering off (timeout 0)      -> go on: the proxy answers 503 as before
               `max_requests` already held    -> 503 + Retry-After, at once
               else wait (polling every 50 ms) until a worker is available
                    -> go on; or after `timeout_s` -> 503 + Retry-After

The same holding area takes a request that found no worker able to take it although
the pool looked ready (`hold`, or `retry` after the caller's own first attempt: every
worker refused it before the first byte, as a worker that just died does until the
router's probes see it): it waits at least one poll, until a worker is ready again (the
backend's replacement), and is tried again, until the timeout.

A pool scaled to zero thereby answers its first requests once the planner's new worker
is ready, instead of failing them; the number held per pool (`queued`) is one of the
planner's inputs, so a request arriving at zero is what wakes the pool. Polling rather
than a wake-up from the monitor keeps this a hook: the router's probe and admission
code stay as they are, and the cost (a scan every 50 ms) is paid only while requests
are held. Knative's activator buffers the same way in front of a scaled-to-zero service.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from sluice.protocol.errors import ServiceUnavailableError
from sluice.router.pool import Pool

T = TypeVar("T")


class RequestBuffer:
    """Per-pool holding area; touched only on the event loop (no locks)."""

    def __init__(self, max_requests: int, timeout_s: float, poll_s: float = 0.05) -> None:
        self.max_requests = max_requests
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._held: dict[int, int] = {}  # id(pool) -> requests held now

    def queued(self, pool: Pool) -> int:
        """Requests held for `pool` right now."""
        return self._held.get(id(pool), 0)

    @staticmethod
    def ready(pool: Pool) -> bool:
        return any(e.available for e in pool.endpoints.values())

    async def admit(self, pool: Pool) -> None:
        """Return once `pool` has an available worker (or buffering is off); raise
        ServiceUnavailableError (503, Retry-After) when full or after the timeout."""
        if self.timeout_s <= 0 or self.ready(pool):
            return
        if self.queued(pool) >= self.max_requests:
            raise ServiceUnavailableError(
                f"no worker is ready and {self.max_requests} requests are already waiting "
                "for one", retry_after=self.timeout_s, code="no_ready_worker")
        self._held[id(pool)] = self.queued(pool) + 1
        try:
            await asyncio.wait_for(self._until_ready(pool), self.timeout_s)
        except TimeoutError:
            raise ServiceUnavailableError(
                f"no worker became ready within {self.timeout_s:g}s", retry_after=self.timeout_s,
                code="no_ready_worker") from None
        finally:
            self._held[id(pool)] -= 1

    async def hold(self, pool: Pool, attempt: Callable[[], Awaitable[T]],
                   refused: type[ServiceUnavailableError]) -> T:
        """`attempt()`; while it raises `refused` (no worker took the request), `retry`."""
        try:
            return await attempt()
        except ServiceUnavailableError as exc:
            return await self.retry(pool, attempt, refused, exc)

    async def retry(self, pool: Pool, attempt: Callable[[], Awaitable[T]],
                    refused: type[ServiceUnavailableError], error: ServiceUnavailableError
                    ) -> T:
        """`attempt()` just raised `error`. If that is `refused` and buffering is on, the
        request is held (counted in `queued`, the planner's input) and tried again every
        poll once a worker looks ready, until `timeout_s`; else, or then, the last error is
        raised. Never tried again before a poll: the workers it just failed on still look
        ready until the probes eject them, so at once it would fail there again (counting
        toward their breakers and the requests metric a second time)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if (self.timeout_s <= 0 or not isinstance(error, refused)
                    or time.monotonic() >= deadline
                    or self.queued(pool) >= self.max_requests):
                raise error
            self._held[id(pool)] = self.queued(pool) + 1
            try:  # a dead worker still looks ready until it is ejected: at least one poll
                await asyncio.sleep(self.poll_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._until_ready(pool),
                                           max(0.0, deadline - time.monotonic()))
            finally:
                self._held[id(pool)] -= 1
            try:
                return await attempt()
            except ServiceUnavailableError as exc:
                error = exc

    async def _until_ready(self, pool: Pool) -> None:
        while not self.ready(pool):
            await asyncio.sleep(self.poll_s)
