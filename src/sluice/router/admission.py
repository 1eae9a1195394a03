"""The admission queue: hold a pool's requests in the router while no worker has room.

    route -> admission.admit(pool, priority, tenant)
               the pool has room, nobody waiting   -> go on at once (one scan of the pool)
               its band's queue full               -> 429 queue_full + Retry-After, at once
                    (unless another tenant holds more of the band: that tenant's newest
                     waiter gets the 429 and this request takes its place)
               else wait in the band (lower priority value first; tenants share a band
                    by weighted start-time fair queueing)
                    -> granted when a slot frees (a request ends, a worker is added or
                       re-admitted, a limit is raised) -> go on
                    -> or after the band's timeout -> 503 queue_timeout + Retry-After
                    -> or the client hangs up -> removed (the task is cancelled)

A worker has room while the router's in-flight requests there are below
`max_inflight_per_worker` and (when set) the cost model's predicted wait there is below
`max_predicted_wait_s`; workers whose circuit breaker is open have none. Each request
that ends calls `Pool.on_finish`, which grants the next waiters at once; a 100 ms timer
runs only while someone waits, for the changes no request end signals (a worker added,
a breaker half-opening, a fresh scrape).

Fair sharing within a band is start-time fair queueing with unit cost, tagged at the
head of each tenant's FIFO: a tenant's next request starts at
`max(band's virtual time, the finish tag of its last granted request)`, the smallest
start is granted (ties: the oldest request) and becomes the virtual time, and the
tenant's finish tag is that start + 1 / weight. Two backlogged tenants of weights 2 and
1 thereby get 2:1 of the grants; a tenant that arrives late starts at the current
virtual time, not behind the backlog it did not send; requests that time out or hang
up cost their tenant nothing (tags are given at the head, not on arrival). When the
band is full, the tenant with the longest FIFO gives up its newest waiter to a tenant
with a shorter one (longest-queue drop), so one tenant's backlog cannot refuse
everyone else at the door either.

Granting and dispatching must not race: between a waiter's grant and its `pool.dispatch`
(the proxy's first synchronous step after `admit` returns) the grant is counted in
`granted`, and free slots are the workers' minus the grants not yet dispatched.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.protocol.errors import InvalidRequestError, RateLimitError, ServiceUnavailableError
from sluice.router.config import AdmissionConfig
from sluice.router.endpoints import Endpoint, work_units
from sluice.router.pool import Pool

PRIORITY_HEADER = b"x-sluice-priority"
TENANT_HEADER = b"x-sluice-tenant"
UNLIMITED = 1 << 30
POLL_S = 0.1  # re-check for room while requests wait (changes no request end signals)


def request_class(headers: list[tuple[bytes, bytes]]) -> tuple[int, str]:
    """(priority, tenant) from the gateway's headers: priority 0 and tenant "" if absent.
    A priority that is not an integer is a 400 naming the header (as the worker does)."""
    priority, tenant = 0, ""
    for name, value in headers:
        if name == PRIORITY_HEADER:
            try:
                priority = int(value)
            except ValueError:
                raise InvalidRequestError(
                    f"x-sluice-priority must be an integer, got {value.decode('latin-1')!r}",
                    param="x-sluice-priority") from None
        elif name == TENANT_HEADER:
            tenant = value.decode("latin-1")
    return priority, tenant


def pool_label(pool: Pool) -> str:
    """The pool's name in metrics and the admin API: its model, else its first name."""
    names = pool.names()
    return names[0] if names else "*"


def predicted_wait(endpoint: Endpoint) -> float:
    """The cost model's seconds of work ahead of a new request on `endpoint`."""
    s = endpoint.stats()
    return s.overhead_s + s.seconds_per_token * work_units(s, 0.0)


@dataclass(eq=False)
class Waiter:
    future: asyncio.Future[None]
    tenant: str
    seq: int
    since: float
    timer: asyncio.TimerHandle | None = None
    queued: bool = True  # in its band (not granted, timed out or removed)
    granted: bool = False


@dataclass
class Band:
    """One priority's waiters: a FIFO per tenant, served smallest start tag first."""

    tenants: dict[str, deque[Waiter]] = field(default_factory=dict)
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> last finish tag
    vtime: float = 0.0
    size: int = 0

    def push(self, waiter: Waiter) -> None:
        self.tenants.setdefault(waiter.tenant, deque()).append(waiter)
        self.size += 1

    def start(self, tenant: str) -> float:
        """The start tag of `tenant`'s head request."""
        return max(self.vtime, self.finish.get(tenant, 0.0))

    def pop(self, weight: Callable[[str], float]) -> Waiter:
        """The head with the smallest start tag (then the oldest); advances the virtual time
        and the tenant's finish tag by 1 / its weight."""
        tenant = min(self.tenants, key=lambda t: (self.start(t), self.tenants[t][0].seq))
        start = self.start(tenant)
        waiter = self._take(tenant, left=True)
        self.vtime = start
        self.finish[tenant] = start + 1.0 / weight(tenant)
        for idle in [t for t, f in self.finish.items() if f <= start and t not in self.tenants]:
            del self.finish[idle]  # its next start would be the virtual time anyway
        return waiter

    def push_out(self, tenant: str) -> Waiter | None:
        """Make room for `tenant` in a full band: the newest waiter of the tenant with the
        longest FIFO, if that is longer than `tenant`'s by more than one; else None."""
        if not self.tenants:
            return None
        longest = max(self.tenants, key=lambda t: len(self.tenants[t]))
        own = len(self.tenants.get(tenant, ()))
        return self._take(longest, left=False) if len(self.tenants[longest]) > own + 1 else None

    def remove(self, waiter: Waiter) -> None:
        queue = self.tenants[waiter.tenant]
        queue.remove(waiter)
        if not queue:
            del self.tenants[waiter.tenant]
        self.size -= 1
        waiter.queued = False

    def _take(self, tenant: str, left: bool) -> Waiter:
        queue = self.tenants[tenant]
        waiter = queue.popleft() if left else queue.pop()
        if not queue:
            del self.tenants[tenant]
        self.size -= 1
        waiter.queued = False
        return waiter


class PoolQueue:
    """One pool's bands and settings; touched only on the event loop (no locks).

    `config` may be replaced at runtime (the admin API); new limits apply to the next
    request, and a raised limit grants waiters at once."""

    def __init__(self, pool: Pool, config: AdmissionConfig, blocked: Callable[[Pool], set[str]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.config = config
        self.blocked = blocked  # urls whose breaker is open
        self.clock = clock
        self.bands: dict[int, Band] = {}
        self.granted = 0  # granted, not yet dispatched
        self.waiting = 0
        self._label = "*"
        self._seq = 0
        self._poll: asyncio.TimerHandle | None = None
        pool.on_finish = self.pump

    @property
    def label(self) -> str:
        """`pool_label`, kept once known (a pool without a configured model learns its
        names from the workers)."""
        if self._label == "*":
            self._label = pool_label(self.pool)
        return self._label

    def free_slots(self) -> int:
        """Requests the pool can start now, less grants not yet dispatched. Unlimited when
        the queue is off, or when no worker could take a request at all (nothing to wait
        for: the buffer holds a pool with no ready worker, else the proxy answers 503)."""
        limit, max_wait = self.config.max_inflight_per_worker, self.config.max_predicted_wait_s
        if not limit and not max_wait:
            return UNLIMITED
        blocked = self.blocked(self.pool)
        slots, workers = 0, 0
        for e in self.pool.endpoints.values():
            if not e.available or e.url in blocked:
                continue
            workers += 1
            if max_wait and predicted_wait(e) >= max_wait:
                continue
            slots += max(0, limit - e.inflight) if limit else 1
        return slots - self.granted if workers else UNLIMITED

    def queued(self, priority: int) -> int:
        band = self.bands.get(priority)
        return band.size if band is not None else 0

    async def wait(self, priority: int, tenant: str) -> float:
        """Queue and wait for a grant; returns the seconds waited.
        Raises RateLimitError (429) if the band is full, ServiceUnavailableError (503)
        after its timeout; cancelled (client gone): leaves the queue."""
        limits = self.config.band(priority)
        band = self.bands.setdefault(priority, Band())
        if band.size >= limits.capacity:
            victim = band.push_out(tenant)
            full = RateLimitError(
                f"the admission queue of priority {priority} is full ({limits.capacity} "
                "requests wait for a free worker)", retry_after=limits.timeout_s,
                code="queue_full")
            if victim is None:
                raise full
            self.waiting -= 1
            if victim.timer is not None:
                victim.timer.cancel()
            if not victim.future.done():
                victim.future.set_exception(full)
        loop = asyncio.get_running_loop()
        self._seq += 1
        waiter = Waiter(loop.create_future(), tenant, self._seq, self.clock())
        band.push(waiter)
        self.waiting += 1
        waiter.timer = loop.call_later(limits.timeout_s, self._expire, priority, waiter,
                                       limits.timeout_s)
        self.pump()
        try:
            await waiter.future
        except asyncio.CancelledError:
            self._leave(priority, waiter)
            raise
        self.granted -= 1  # the caller dispatches before its next await
        loop.call_soon(self.pump)  # a predicted-wait slot is known only after dispatch
        return self.clock() - waiter.since

    def pump(self) -> None:
        """Grant waiters, best band first, while the pool has free slots."""
        if not self.waiting:
            return
        slots = self.free_slots()
        while slots > 0 and self.waiting:
            band = self.bands[min(p for p, b in self.bands.items() if b.size)]
            waiter = band.pop(self.config.weight)
            self.waiting -= 1
            if waiter.timer is not None:
                waiter.timer.cancel()
            if waiter.future.done():  # cancelled: its task has not run `_leave` yet
                continue
            waiter.granted = True
            waiter.future.set_result(None)
            self.granted += 1
            slots -= 1
        self._arm_poll()

    def _arm_poll(self) -> None:
        if self.waiting and self._poll is None:
            self._poll = asyncio.get_running_loop().call_later(POLL_S, self._on_poll)

    def _on_poll(self) -> None:
        self._poll = None
        self.pump()
        self._arm_poll()

    def _leave(self, priority: int, waiter: Waiter) -> None:
        """A cancelled waiter: out of its band, or its grant handed on."""
        if waiter.timer is not None:
            waiter.timer.cancel()
        if waiter.granted:
            self.granted -= 1
            self.pump()
        elif waiter.queued:
            self.bands[priority].remove(waiter)
            self.waiting -= 1

    def _expire(self, priority: int, waiter: Waiter, timeout_s: float) -> None:
        if not waiter.queued or waiter.future.done():
            return
        self.bands[priority].remove(waiter)
        self.waiting -= 1
        waiter.future.set_exception(ServiceUnavailableError(
            f"no worker had room for this request within {timeout_s:g}s "
            f"(priority {priority})", retry_after=timeout_s, code="queue_timeout"))


class Admission:
    """Every pool's admission queue, created on a pool's first request.

    `wait_seconds` and `shed` are the router's histogram and counter; `blocked(pool)`
    names the workers whose circuit breaker is open."""

    def __init__(self, config: AdmissionConfig, blocked: Callable[[Pool], set[str]],
                 wait_seconds: Histogram, shed: Counter) -> None:
        self.config = config
        self.blocked = blocked
        self.wait_seconds = wait_seconds
        self.shed = shed
        self.queues: dict[int, PoolQueue] = {}  # id(pool) ->
        self._children: dict[tuple[str, int, str], Histogram | Counter] = {}

    def queue(self, pool: Pool) -> PoolQueue:
        queue = self.queues.get(id(pool))
        if queue is None:
            config = pool.config.admission or self.config
            queue = self.queues[id(pool)] = PoolQueue(pool, config, self.blocked)
        return queue

    async def admit(self, pool: Pool, headers: list[tuple[bytes, bytes]]) -> None:
        """Return when `pool` may take this request now; it must be dispatched before the
        caller's next await. Raises 400 (bad priority), 429 (band full), 503 (timed out)."""
        priority, tenant = request_class(headers)
        queue = self.queue(pool)
        label = queue.label
        if not queue.waiting and queue.free_slots() > 0:
            self._wait_child(label, priority).observe(0.0)
            return
        try:
            waited = await queue.wait(priority, tenant)
        except (RateLimitError, ServiceUnavailableError) as exc:
            self._shed_child(label, priority, str(exc.code)).inc()
            raise
        self._wait_child(label, priority).observe(waited)

    def _wait_child(self, label: str, priority: int) -> Histogram:
        key = (label, priority, "")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.wait_seconds.labels(label, str(priority))
        return child  # type: ignore[return-value]

    def _shed_child(self, label: str, priority: int, reason: str) -> Counter:
        key = (label, priority, reason)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.shed.labels(label, str(priority), reason)
        return child  # type: ignore[return-value]

    def describe(self, pool: Pool) -> dict[str, object]:
        """The pool's settings and queue, for GET/PUT /admin/pools/{model}/admission."""
        queue = self.queue(pool)
        c = queue.config
        return {
            "model": pool_label(pool), "enabled": c.enabled,
            "max_inflight_per_worker": c.max_inflight_per_worker,
            "max_predicted_wait_s": c.max_predicted_wait_s,
            "default_band": {"capacity": c.default_band.capacity,
                             "timeout_s": c.default_band.timeout_s},
            "bands": {str(p): {"capacity": b.capacity, "timeout_s": b.timeout_s}
                      for p, b in sorted(c.bands.items())},
            "tenant_weights": dict(c.tenant_weights),
            "free_slots": max(0, queue.free_slots()) if c.enabled else None,
            "queued": {str(p): b.size for p, b in sorted(queue.bands.items()) if b.size},
        }

    def reconfigure(self, pool: Pool, config: AdmissionConfig) -> None:
        """New settings for `pool` (the admin API); waiters are granted if there is room."""
        queue = self.queue(pool)
        queue.config = config
        queue.pump()


class AdmissionCollector(Collector):
    """`sluice_router_admission_queued{model,priority}`, read at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("sluice_router_admission_queued",
                                "requests waiting in the router's admission queue",
                                labels=["model", "priority"])
        for queue in self.admission.queues.values():
            label = queue.label
            for priority, band in sorted(queue.bands.items()):
                fam.add_metric([label, str(priority)], float(band.size))
        yield fam
