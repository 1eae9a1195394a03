"""The control loop of one pool, in the router's process: signals -> planner -> backend.

    every interval_s:
      supervise   each worker the backend reports DEAD leaves the router (it is
                  replaced below, because the pool is now short of the desired count);
                  one whose /health failed for `liveness_timeout_s` is killed likewise
      scrape      the workers' latency histograms into the window (TTFT p90, ITL)
      decide      planner.decide(pool_signals(...), now)
      P:D         a disaggregated pool: move a worker between prefill and decode by a
                  live role switch (control/pd.py); new workers start with the role
                  the ratio wants (`sluice worker --role`)
      reconcile   short: start workers of the pool's current model (each joins the
                        router once /health is 200 and its probe passed)
                  over: cancel starting workers first, then drain the ready worker
                        with the least in flight:
                          router stops routing to it (Endpoint.draining)
                          -> its in-flight requests finish (up to drain_grace_s)
                          -> it leaves the router -> backend.stop(drain=True)
                  (held while a model swap runs: `control/swap.py`)

Only this loop and a model swap add or remove the pool's workers, and reconcile waits
while a swap runs, so no step locks: starts and drains run as tasks and the counts
(`live`) include them while they run. The router keeps serving throughout; a request
never sees a worker that is not ready or is draining. `attach(app, controllers)` runs
the loops in the router app's lifespan, serves `GET /admin/planner` and
`GET|POST /admin/pools/{pool}/model`, and exports the planner's gauges on the router's
/metrics.

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

from sluice.control.backend import Backend, ModelSpec, WorkerHandle, WorkerHealth
from sluice.control.pd import PDController
from sluice.control.planner import Decision, Planner
from sluice.control.signals import LatencyWindow, parse_latency, pool_signals
from sluice.control.swap import Swap, describe_spec, parse_model_spec
from sluice.protocol.errors import (
    ConflictError,
    InvalidRequestError,
    ServiceUnavailableError,
    check_number,
)
from sluice.router.config import WorkerSpec
from sluice.router.endpoints import Endpoint
from sluice.router.pool import Pool
from sluice.router.state import RouterState

log = logging.getLogger(__name__)
LOST = frozenset({"dead", "unresponsive"})  # events of a worker lost, not stopped


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 1.0
    drain_grace_s: float = 30.0  # a draining worker's streams may take this long
    latency_window_s: float = 30.0
    events: int = 200  # scale events kept for /admin/planner
    # after a worker failed to start, the next start waits this long, doubled per failure
    # in a row up to the max (Kubernetes' CrashLoopBackOff: 10 s doubling to 5 min)
    start_backoff_s: float = 1.0
    start_backoff_max_s: float = 60.0
    # a ready worker whose /health fails this long (hung, stopped, wedged) is killed and
    # replaced, as the rendered Kubernetes liveness probe does (10 s x 6)
    liveness_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        check_number("interval_s", self.interval_s, "must be > 0", lambda v: v > 0)
        check_number("drain_grace_s", self.drain_grace_s, "must be >= 0", lambda v: v >= 0)
        check_number("latency_window_s", self.latency_window_s, "must be > 0", lambda v: v > 0)
        check_number("events", self.events, "must be >= 1", lambda v: v >= 1)
        check_number("start_backoff_s", self.start_backoff_s, "must be >= 0", lambda v: v >= 0)
        check_number("liveness_timeout_s", self.liveness_timeout_s, "must be > 0",
                     lambda v: v > 0)
        check_number("start_backoff_max_s", self.start_backoff_max_s,
                     "must be >= start_backoff_s", lambda v: v >= self.start_backoff_s)


class Controller:
    """Keeps one pool's workers at the planner's count; owns the pool's membership.

    `model`: what the pool's workers load (None: the backend's own worker arguments);
    a swap replaces it and bumps `revision` (1 for the model the pool started with). Each
    swap attempt takes the next revision number, so a failed one leaves a gap."""

    def __init__(self, name: str, state: RouterState, pool: Pool, backend: Backend | None,
                 planner: Planner, config: ControllerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 model: ModelSpec | None = None) -> None:
        self.name, self.state, self.pool = name, state, pool
        self.backend, self.planner = backend, planner
        self.config = config or ControllerConfig()
        self.clock = clock
        self.latency = LatencyWindow(self.config.latency_window_s)
        self.workers: dict[str, WorkerHandle] = {}  # url -> handle, in the router
        self.revisions: dict[str, int] = {}  # url -> the revision it runs
        self.starting: set[asyncio.Task[None]] = set()
        self.draining: dict[str, asyncio.Task[None]] = {}
        self.events: deque[dict[str, Any]] = deque(maxlen=self.config.events)
        self.last: Decision | None = None
        self.model, self.revision = model, 1
        self.swap: Swap | None = None  # the running or last swap
        self.swap_task: asyncio.Task[None] | None = None
        self.pd: PDController | None = None  # a disaggregated pool's P:D ratio (pd.py)
        self.last_start_error: str | None = None
        self.start_failures = 0  # in a row, by the pool's own starts (not a swap's)
        self.unhealthy_since: dict[str, float] = {}  # url -> when its /health began failing
        self.next_start_at = 0.0  # reconcile starts no worker before this (backoff)
        self.initial_error: str | None = None  # start_initial: no worker started

    # --- the loop -------------------------------------------------------------------------

    @property
    def live(self) -> int:
        """Workers counted toward the desired number: ready or starting, not draining."""
        return len(self.workers) - len(self.draining) + len(self.starting)

    async def run(self) -> None:
        """Step every `interval_s` until cancelled. A failing step is logged and the next
        one runs: any error (a planner bug, a degenerate signal) must not end the loop,
        which also replaces dead workers. Cancellation ends it."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except (httpx.HTTPError, OSError) as exc:  # a worker or the backend, passing
                log.warning("control step for pool %s failed: %s", self.name, exc)
            except Exception:
                log.exception("control step for pool %s failed", self.name)

    async def step(self) -> Decision:
        now = self.clock()
        if self.backend is not None:
            await self.supervise()
        await self.scrape(now)
        signals = pool_signals(self.name, self.pool, self.state.buffer, len(self.starting),
                               self.latency)
        self.last = self.planner.decide(signals, now)
        if self.backend is not None and not self.swapping:
            self.reconcile(self.last.desired)
        if self.pd is not None:
            self.pd.step()
        return self.last

    @property
    def swapping(self) -> bool:
        return self.swap is not None and self.swap.running

    async def start_initial(self) -> None:
        """Start the planner's initial count and wait until they are ready (or failed).
        When every one failed (a model that does not load, a flag the worker refuses)
        raises `ServiceUnavailableError` with the last failure (the worker's log tail),
        kept in `initial_error`: the pool would retry it every second, and `sluice serve`
        listened with no worker, answering 503 after the buffer timeout."""
        if self.backend is None:
            return
        self.reconcile(self.planner.desired)
        await asyncio.gather(*self.starting, return_exceptions=True)
        if not self.workers and self.last_start_error is not None:
            self.initial_error = f"no worker of pool {self.name} started: {self.last_start_error}"
            raise ServiceUnavailableError(self.initial_error, code="no_worker_started")

    async def supervise(self) -> None:
        """Take dead workers out of the router, and kill those whose /health has failed
        for `liveness_timeout_s` (a hung process is alive to its backend but serves
        nothing: it held its place in the pool for good); the next reconcile replaces
        them."""
        assert self.backend is not None
        for url, handle in list(self.workers.items()):
            if url in self.draining:
                continue
            health = await self.backend.health(handle)
            # a drain may have ended (worker stopped, forgotten) while we awaited
            if self.workers.get(url) is not handle or url in self.draining:
                continue
            if health is WorkerHealth.DEAD:
                await self.remove(url)
                self.event("dead", handle)
            elif health is WorkerHealth.READY:
                self.unhealthy_since.pop(url, None)
            elif self.clock() - self.unhealthy_since.setdefault(url, self.clock()) \
                    >= self.config.liveness_timeout_s:
                await self.remove(url)
                await self.backend.stop(handle, drain=False)
                self.event("unresponsive", handle, seconds=self.config.liveness_timeout_s)

    async def remove(self, url: str) -> None:
        """Forget a worker and take it out of the router."""
        self.forget(url)
        if url in self.pool.endpoints:
            await self.state.remove_worker(url)

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
        """Start or drain workers toward `desired` (tasks; returns at once). Starts wait
        out the backoff after failed ones (`next_start_at`)."""
        if self.clock() >= self.next_start_at:
            for _ in range(desired - self.live):
                self._spawn(self._start())
        excess = self.live - desired
        for task in sorted(self.starting, key=id)[:max(0, excess)]:
            task.cancel()  # the backend kills a worker whose start is cancelled
            excess -= 1
        for endpoint in self.drain_order()[:max(0, excess)]:
            self.drain(endpoint)

    def drain_order(self) -> list[Endpoint]:
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
        """One worker of the pool's current model, routable once its probe passed."""
        started = self.clock()
        role = self.pd.next_role() if self.pd is not None else None
        model = self.model
        if role is not None and model is not None:  # `sluice worker --role ROLE`
            model = ModelSpec(model.model, {**model.options, "role": role})
        try:
            handle = await self.boot(model, self.revision)
        except (OSError, RuntimeError, TimeoutError):
            self.back_off()
            return
        finally:
            if role is not None and self.pd is not None:
                self.pd.started(role)
        endpoint = await self.join(handle, self.revision, started, role)
        if endpoint is None:
            self.back_off()
            return
        endpoint.draining = False

    def back_off(self) -> None:
        """A start failed: the next waits `start_backoff_s`, doubled per failure in a row.
        Without it a worker that cannot start (its model gone, its port range used up)
        was started again every second, each failure logging its worker's log tail."""
        self.start_failures += 1
        delay = min(self.config.start_backoff_s * 2 ** (self.start_failures - 1),
                    self.config.start_backoff_max_s)
        self.next_start_at = self.clock() + delay
        log.warning("pool %s: %d worker start(s) failed in a row; the next in %gs",
                    self.name, self.start_failures, delay)

    async def boot(self, model: ModelSpec | None, revision: int) -> WorkerHandle:
        """Start one worker of `model` through the backend, until /health 200; a failure
        is logged, recorded (start_failed) and raised."""
        self.event("start", revision=revision)
        assert self.backend is not None
        try:
            return await self.backend.start(model)
        except (OSError, RuntimeError, TimeoutError) as exc:
            log.warning("pool %s: a worker failed to start: %s", self.name, exc)
            self.event("start_failed", error=str(exc)[:500])
            self.last_start_error = str(exc)
            raise

    async def join(self, handle: WorkerHandle, revision: int, started: float,
                   role: str | None = None) -> Endpoint | None:
        """Add a started worker to the router, held back (draining) until the caller lets
        it take requests, once its probe passed (`serves`), as POST /admin/workers holds
        a worker until probed. One that fails it is stopped without a request (event
        `refused`, recorded in `last_start_error`) and None is returned."""
        endpoint = self.pool.add(WorkerSpec(handle.url, kv_events=handle.kv_events, role=role))
        endpoint.draining = True
        endpoint.hold_until_probed()
        self.state.start_subscriber(self.pool, endpoint)
        try:  # a probe lost to a busy moment is tried again, as the monitor ejects
            for _ in range(self.state.monitor.eject_after):  # only at the third failure
                if await self.state.monitor.probe(endpoint):
                    break
        except asyncio.CancelledError:  # a start cancelled here would leak the worker
            await self.discard(handle)
            raise
        if not self.serves(endpoint):
            await self.refuse(handle, endpoint)
            return None
        self.workers[handle.url], self.revisions[handle.url] = handle, revision
        self.start_failures, self.next_start_at = 0, 0.0  # workers start again
        self.event("ready", handle, seconds=round(self.clock() - started, 3))
        return endpoint

    def serves(self, endpoint: Endpoint) -> bool:
        """Its probe passed, by POST /admin/workers's rule: /health answered 200, and
        /v1/models lists the pool's model or one the pool's other workers list (a pool
        may serve its workers' model under a name of its own: the router rewrites it);
        a pool's only worker is not compared (`Pool.foreign`)."""
        return endpoint.healthy and not self.pool.foreign(endpoint, self.pool.config.model)

    async def refuse(self, handle: WorkerHandle, endpoint: Endpoint) -> None:
        """A started worker failed its probe: record why, then stop it unused."""
        error = (f"worker {handle.url} is not healthy or does not serve "
                 f"{self.pool.config.model!r} (it lists {list(endpoint.models)})")
        log.warning("pool %s: %s", self.name, error)
        self.event("refused", handle, error=error)
        self.last_start_error = error
        await self.discard(handle)

    async def discard(self, handle: WorkerHandle) -> None:
        """Take a worker that never took a request out of the router and stop it now."""
        await self.remove(handle.url)
        assert self.backend is not None
        await self.backend.stop(handle, drain=False)
        self.event("stopped", handle, unfinished=0)

    async def cancel_starts(self) -> None:
        """Cancel the starts in flight and wait until they are gone (the backend kills a
        worker whose start is cancelled)."""
        for task in list(self.starting):
            task.cancel()
        await asyncio.gather(*self.starting, return_exceptions=True)

    def forget(self, url: str) -> None:
        self.workers.pop(url, None)
        self.revisions.pop(url, None)
        self.unhealthy_since.pop(url, None)

    def drain(self, endpoint: Endpoint) -> None:
        """Stop routing to `endpoint` now (this event-loop turn); a task lets its requests
        finish, then stops it (`draining[url]` until done)."""
        endpoint.draining = True
        self.draining[endpoint.url] = asyncio.create_task(self._drain(endpoint))

    async def _drain(self, endpoint: Endpoint) -> None:
        """Let its requests finish (bounded), take it out of the router, then stop it."""
        handle = self.workers[endpoint.url]
        self.event("drain", handle, inflight=endpoint.inflight)
        deadline = self.clock() + self.config.drain_grace_s
        try:
            while endpoint.inflight > 0 and self.clock() < deadline:
                await asyncio.sleep(0.05)
            if endpoint.url in self.pool.endpoints:
                await self.state.remove_worker(endpoint.url)
            assert self.backend is not None
            await self.backend.stop(handle, drain=True)
            self.event("stopped", handle, unfinished=endpoint.inflight)
        finally:
            self.forget(endpoint.url)
            self.draining.pop(endpoint.url, None)

    def event(self, kind: str, handle: WorkerHandle | None = None, **extra: Any) -> None:
        """Record a scale or swap event (GET /admin/planner) and log it: INFO, WARNING for
        a worker lost (`LOST`), which the status page's recent errors then show."""
        event = {"at": self.clock(), "pool": self.name, "event": kind,
                 "worker": handle.url if handle else None, **extra}
        self.events.append(event)
        log.log(logging.WARNING if kind in LOST else logging.INFO, "pool %s: %s %s %s",
                self.name, kind, event["worker"] or "", extra or "")

    # --- model swap -------------------------------------------------------------------------

    def swap_model(self, body: bytes) -> dict[str, Any]:
        """Start a blue/green swap to the model in `body` (POST /admin/pools/{pool}/model):
        400 for a bad body, a pool without a backend or a model its backend cannot find
        (`Backend.check_model`), 409 while a swap runs. Returns
        the pool's model view at once; the swap runs as a task (`control/swap.py`)."""
        spec = parse_model_spec(body)
        if self.backend is None:
            raise InvalidRequestError(f"pool {self.name} has no backend here (its workers are "
                                      "placed outside sluice): roll out their Deployment "
                                      "instead", param="pool", code="external_workers")
        self.backend.check_model(spec)
        running = self.swap
        if running is not None and running.running:
            raise ConflictError(f"pool {self.name} is already swapping to revision "
                                f"{running.revision} ({running.state})",
                                code="swap_in_progress")
        # every attempt its own revision: a failed swap's number is not handed out again
        last = running.revision if running is not None else self.revision
        self.swap = Swap(self, spec, max(self.revision, last) + 1, workers=max(1, self.live))
        self.swap_task = asyncio.create_task(self.swap.run())
        return self.model_view()

    def model_view(self) -> dict[str, Any]:
        """GET /admin/pools/{pool}/model: the current model, each worker's revision, the
        running or last swap."""
        return {"pool": self.name, "revision": self.revision,
                "model": describe_spec(self.model),
                "workers": [{"url": url, "revision": self.revisions.get(url),
                             "draining": url in self.draining} for url in sorted(self.workers)],
                "swap": self.swap.describe() if self.swap is not None else None}

    # --- views and shutdown -----------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        backend = self.backend.name if self.backend is not None else "external"
        return {"pool": self.name, "backend": backend, "live": self.live,
                "workers": sorted(self.workers), "draining": sorted(self.draining),
                "starting": len(self.starting), "revision": self.revision,
                "swap": self.swap.describe() if self.swap is not None else None,
                **self.planner.describe(), "events": list(self.events),
                **({"pd": self.pd.describe()} if self.pd is not None else {})}

    async def close(self) -> None:
        """Cancel starts and a running swap, let drains finish, stop every worker the
        backend still has."""
        for task in [*self.starting, *([self.swap_task] if self.swap_task else [])]:
            task.cancel()
        await asyncio.gather(*self.starting, *self.draining.values(),
                             *([self.swap_task] if self.swap_task else []),
                             return_exceptions=True)
        if self.backend is not None:
            await self.backend.close()


def attach(app: Any, controllers: Sequence[Controller] | Callable[[RouterState],
           Sequence[Controller]]) -> None:
    """Run `controllers` inside the router app's lifespan (after the router's state is up,
    stopped before it closes), serve GET /admin/planner, export the planner gauges.

    `controllers` may be a function of the `RouterState`, since the state is created in
    the lifespan."""
    from sluice.control.metrics import PlannerCollector
    from sluice.router.model_admin import model_router
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
            tasks: list[asyncio.Task[None]] = []
            try:  # a pool whose workers all failed to start fails the startup
                await asyncio.gather(*(c.start_initial() for c in running))
                tasks = [asyncio.create_task(c.run()) for c in running]
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
    app.include_router(model_router(
        lambda pool: next((c for c in running if c.pool is pool), None)))
