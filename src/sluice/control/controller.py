"""The control loop of one pool, in the router's process: signals -> planner -> backend.

    every interval_s:
      supervise   each worker the backend reports DEAD leaves the router (it is
                  replaced below, because the pool is now short of the desired count)
      scrape      the workers' latency histograms into the window (TTFT p90, ITL)
      decide      planner.decide(pool_signals(...), now)
      reconcile   short: start workers (each joins the router once /health is 200)
                  over: cancel starting workers first, then drain the ready worker
                        with the least in flight:
                          router stops routing to it (Endpoint.draining)
                          -> its in-flight requests finish (up to drain_grace_s)
                          -> it leaves the router -> backend.stop(drain=True)

Only this loop adds or removes the pool's workers, so no step locks: starts and drains
run as tasks and the counts (`live`) include them while they run. The router keeps
serving throughout; a request never sees a worker that is not ready or is draining.
`attach(app, controllers)` runs the loops in the router app's lifespan, serves
`GET /admin/planner` and exports the planner's gauges on the router's /metrics.

Without a backend (`backend=None`: workers placed by someone else, e.g. Kubernetes) the
loop only observes and decides: `sluice:desired_replicas` is then the output, for KEDA
or an HPA to act on, and the pool's workers are whatever the router was given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from sluice.control.backend import Backend, WorkerHandle, WorkerHealth
from sluice.control.planner import Decision, Planner
from sluice.control.signals import LatencyWindow, parse_latency, pool_signals
from sluice.router.config import WorkerSpec
from sluice.router.endpoints import Endpoint
from sluice.router.pool import Pool
from sluice.router.state import RouterState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 1.0
    drain_grace_s: float = 30.0  # a draining worker's streams may take this long
    latency_window_s: float = 30.0
    events: int = 200  # scale events kept for /admin/planner

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.drain_grace_s < 0 or self.latency_window_s <= 0:
            raise ValueError("controller intervals must be positive")


class Controller:
    """Keeps one pool's workers at the planner's count; owns the pool's membership."""

    def __init__(self, name: str, state: RouterState, pool: Pool, backend: Backend | None,
                 planner: Planner, config: ControllerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.state, self.pool = name, state, pool
        self.backend, self.planner = backend, planner
        self.config = config or ControllerConfig()
        self.clock = clock
        self.latency = LatencyWindow(self.config.latency_window_s)
        self.workers: dict[str, WorkerHandle] = {}  # url -> handle, in the router
        self.starting: set[asyncio.Task[None]] = set()
        self.draining: dict[str, asyncio.Task[None]] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=self.config.events)
        self.last: Decision | None = None

    # --- the loop -------------------------------------------------------------------------

    @property
    def live(self) -> int:
        """Workers counted toward the desired number: ready or starting, not draining."""
        return len(self.workers) - len(self.draining) + len(self.starting)

    async def run(self) -> None:
        """Step every `interval_s` until cancelled; a failing step is logged, not fatal."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except (httpx.HTTPError, OSError, RuntimeError) as exc:
                log.warning("control step for pool %s failed: %s", self.name, exc)

    async def step(self) -> Decision:
        now = self.clock()
        if self.backend is not None:
            await self.supervise()
        await self.scrape(now)
        signals = pool_signals(self.name, self.pool, self.state.buffer, len(self.starting),
                               self.latency)
        self.last = self.planner.decide(signals, now)
        if self.backend is not None:
            self.reconcile(self.last.desired)
        return self.last

    async def start_initial(self) -> None:
        """Start the planner's initial count and wait until they are ready (or failed)."""
        if self.backend is None:
            return
        self.reconcile(self.planner.desired)
        await asyncio.gather(*self.starting, return_exceptions=True)

    async def supervise(self) -> None:
        """Take dead workers out of the router; the next reconcile replaces them."""
        assert self.backend is not None
        for url, handle in list(self.workers.items()):
            if url in self.draining:
                continue
            if await self.backend.health(handle) is WorkerHealth.DEAD:
                del self.workers[url]
                if url in self.pool.endpoints:
                    await self.state.remove_worker(url)
                self._event("dead", handle)

    async def scrape(self, now: float) -> None:
        urls = list(self.workers) if self.backend is not None else list(self.pool.endpoints)
        texts = await asyncio.gather(*(self._metrics(url) for url in urls))
        for url, text in zip(urls, texts, strict=True):
            if text is not None:
                self.latency.observe(url, now, parse_latency(text))
        self.latency.forget(urls)

    async def _metrics(self, url: str) -> str | None:
        try:
            resp = await self.state.client.get(url + "/metrics", timeout=2.0)
        except httpx.HTTPError:
            return None
        return resp.text if resp.status_code == 200 else None

    def reconcile(self, desired: int) -> None:
        """Start or drain workers toward `desired` (tasks; returns at once)."""
        for _ in range(desired - self.live):
            self._spawn(self._start())
        excess = self.live - desired
        for task in sorted(self.starting, key=id)[:max(0, excess)]:
            task.cancel()  # the backend kills a worker whose start is cancelled
            excess -= 1
        for endpoint in self._drain_order()[:max(0, excess)]:
            self.draining[endpoint.url] = asyncio.create_task(self._drain(endpoint))

    def _drain_order(self) -> list[Endpoint]:
        """Ready workers not yet draining, least in flight first."""
        candidates = [self.pool.endpoints[url] for url in self.workers
                      if url not in self.draining and url in self.pool.endpoints]
        return sorted(candidates, key=lambda e: (e.inflight, e.url))

    # --- one worker's life ------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self.starting.add(task)
        task.add_done_callback(self.starting.discard)

    async def _start(self) -> None:
        started = self.clock()
        self._event("start", None)
        assert self.backend is not None
        try:
            handle = await self.backend.start()
        except (OSError, RuntimeError, TimeoutError) as exc:
            log.warning("pool %s: a worker failed to start: %s", self.name, exc)
            self._event("start_failed", None, error=str(exc)[:500])
            return
        endpoint = self.pool.add(WorkerSpec(handle.url, kv_events=handle.kv_events))
        self.state.start_subscriber(self.pool, endpoint)
        await self.state.monitor.probe(endpoint)
        self.workers[handle.url] = handle
        self._event("ready", handle, seconds=round(self.clock() - started, 3))

    async def _drain(self, endpoint: Endpoint) -> None:
        """Stop routing to it, let its requests finish (bounded), then stop it."""
        handle = self.workers[endpoint.url]
        endpoint.draining = True
        self._event("drain", handle, inflight=endpoint.inflight)
        deadline = self.clock() + self.config.drain_grace_s
        try:
            while endpoint.inflight > 0 and self.clock() < deadline:
                await asyncio.sleep(0.05)
            if endpoint.url in self.pool.endpoints:
                await self.state.remove_worker(endpoint.url)
            assert self.backend is not None
            await self.backend.stop(handle, drain=True)
            self._event("stopped", handle, unfinished=endpoint.inflight)
        finally:
            self.workers.pop(endpoint.url, None)
            self.draining.pop(endpoint.url, None)

    def _event(self, kind: str, handle: WorkerHandle | None, **extra: Any) -> None:
        event = {"at": self.clock(), "pool": self.name, "event": kind,
                 "worker": handle.url if handle else None, **extra}
        self.events.append(event)
        log.info("pool %s: %s %s %s", self.name, kind, event["worker"] or "", extra or "")

    # --- views and shutdown -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        backend = self.backend.name if self.backend is not None else "external"
        return {"pool": self.name, "backend": backend, "live": self.live,
                "workers": sorted(self.workers), "draining": sorted(self.draining),
                "starting": len(self.starting), **self.planner.describe(),
                "events": list(self.events)}

    async def close(self) -> None:
        """Cancel starts, let drains finish, stop every worker the backend still has."""
        for task in list(self.starting):
            task.cancel()
        await asyncio.gather(*self.starting, *self.draining.values(), return_exceptions=True)
        if self.backend is not None:
            await self.backend.close()


def attach(app: Any, controllers: Sequence[Controller] | Callable[[RouterState],
           Sequence[Controller]]) -> None:
    """Run `controllers` inside the router app's lifespan (after the router's state is up,
    stopped before it closes), serve GET /admin/planner, export the planner gauges.

    `controllers` may be a function of the `RouterState`, since the state is created in
    the lifespan."""
    from sluice.control.metrics import PlannerCollector
    from sluice.router.planner_admin import planner_router

    inner = app.router.lifespan_context
    running: list[Controller] = []

    @asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[None]:
        async with inner(app_):
            state: RouterState = app_.state.router
            made = controllers(state) if callable(controllers) else controllers
            running[:] = list(made)
            state.metrics.registry.register(PlannerCollector(lambda: running))
            await asyncio.gather(*(c.start_initial() for c in running))
            tasks = [asyncio.create_task(c.run()) for c in running]
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                results = await asyncio.gather(*(c.close() for c in running),
                                               return_exceptions=True)
                for c, result in zip(running, results, strict=True):
                    if isinstance(result, BaseException):
                        log.warning("pool %s: closing its workers failed: %s", c.name, result)

    app.router.lifespan_context = lifespan
    app.include_router(planner_router(lambda: {"pools": [c.describe() for c in running]}))
