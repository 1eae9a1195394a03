"""Circuit breakers per worker, retry backoff and the retry budget: the request path's
protection against a worker that fails requests while its health probe still passes,
and against retries that would multiply an outage.

    closed --(`failures` in a row, each within `window_s` of the last)--> open
      ^                                     (unless fewer than `min_closed` other
      |                                      available workers would stay closed)
      |                                                   |  after `open_s`
      +--(`successes` trials succeed)-- half_open <-------+
                                          |  a trial fails
                                          +-------------------> open

A request's outcome is known at its first byte: a connect error, a read error or a 5xx
other than 503 is a failure; any other status a success (a 4xx is the client's fault);
a 503 (a busy worker shedding load) and a cancelled attempt count as neither. Half-open
lets at most `successes` trials in flight at once; the others see the worker as open.

Retries (before the first byte, on another worker) wait `backoff_s` x 2^(n-1), capped
at `backoff_max_s`, half of it jittered, and each needs the pool's retry budget: retries
in the last `budget_window_s` may reach `budget_ratio` x its requests there plus
`budget_min`. A pool whose workers all fail thereby sends at most ~1.2x its requests,
not 1 + max_retries times them (Finagle's and Envoy's retry budgets, same idea).

Everything runs on the event loop (no locks); `clock` is injectable for tests.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sluice.router.config import BreakerConfig
from sluice.router.pool import Pool

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUE = {CLOSED: 0.0, OPEN: 1.0, HALF_OPEN: 2.0}  # SGLang's encoding of the gauge
BUDGET_SLOTS = 10  # the budget window is counted in this many slots


@dataclass
class Breaker:
    """One worker's circuit (created at its first failure; absent means closed, clean)."""

    state: str = CLOSED
    failures: int = 0  # consecutive, while closed
    last_failure: float = -math.inf
    opened_at: float = 0.0
    successes: int = 0  # while half-open
    trials: int = 0  # half-open requests in flight


class RetryBudget:
    """Requests and retries of one pool over a sliding window of `BUDGET_SLOTS` slots."""

    def __init__(self, config: BreakerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.width = config.budget_window_s / BUDGET_SLOTS
        self.slots: deque[list[int]] = deque()  # [slot index, requests, retries]

    def _slot(self) -> list[int]:
        index = int(self.clock() // self.width)
        while self.slots and self.slots[0][0] <= index - BUDGET_SLOTS:
            self.slots.popleft()
        if not self.slots or self.slots[-1][0] != index:
            self.slots.append([index, 0, 0])
        return self.slots[-1]

    def request(self) -> None:
        self._slot()[1] += 1

    def take_retry(self) -> bool:
        """Count a retry if the budget has room; False (nothing counted) if not."""
        slot = self._slot()
        requests = sum(s[1] for s in self.slots)
        retries = sum(s[2] for s in self.slots)
        if retries >= self.config.budget_ratio * requests + self.config.budget_min:
            return False
        slot[2] += 1
        return True


class Breakers:
    """Every worker's breaker (by url) and every pool's retry budget, for one router.

    `on_transition(worker, from, to)` is called at each state change (the metrics)."""

    def __init__(self, config: BreakerConfig, on_transition: Callable[[str, str, str], None],
                 clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.config = config
        self.on_transition = on_transition
        self.clock = clock
        self.rng = rng or random.Random()
        self.breakers: dict[str, Breaker] = {}
        self.budgets: dict[int, RetryBudget] = {}  # id(pool) ->

    @property
    def enabled(self) -> bool:
        return self.config.failures > 0

    def state(self, url: str) -> str:
        breaker = self.breakers.get(url)
        return breaker.state if breaker is not None else CLOSED

    # --- which workers may take a request -------------------------------------------------

    def blocked(self, pool: Pool) -> set[str]:
        """Urls of `pool` that take no request now: open, or half-open with all trials out.
        An open breaker past `open_s` turns half-open here."""
        out: set[str] = set()
        if not self.breakers:
            return out
        now = self.clock()
        for url, b in self.breakers.items():
            if b.state == CLOSED or url not in pool.endpoints:
                continue
            if b.state == OPEN and now - b.opened_at >= self.config.open_s:
                self._move(url, b, HALF_OPEN)
                b.successes = b.trials = 0
            if b.state == OPEN or b.trials >= self.config.successes:
                out.add(url)
        return out

    def attempt(self, url: str) -> None:
        """A request is being sent to `url` (counts a half-open trial)."""
        b = self.breakers.get(url)
        if b is not None and b.state == HALF_OPEN:
            b.trials += 1

    # --- outcomes ---------------------------------------------------------------------------

    def success(self, url: str) -> None:
        b = self.breakers.get(url)
        if b is None:
            return
        if b.state == HALF_OPEN:
            b.trials = max(0, b.trials - 1)
            b.successes += 1
            if b.successes >= self.config.successes:
                self._move(url, b, CLOSED)
                del self.breakers[url]
        elif b.state == CLOSED:
            del self.breakers[url]  # a clean closed breaker is no entry: `blocked` stays O(1)

    def failure(self, pool: Pool, url: str) -> None:
        """A failed request; opens the breaker when due and the pool's floor allows."""
        now = self.clock()
        b = self.breakers.setdefault(url, Breaker())
        if b.state == HALF_OPEN:
            b.trials = max(0, b.trials - 1)
            self._open(url, b, now)
            return
        if b.state == OPEN:
            return  # sent before it opened
        if now - b.last_failure > self.config.window_s:
            b.failures = 0
        b.failures += 1
        b.last_failure = now
        if b.failures < self.config.failures:
            return
        if self._closed_others(pool, url) < self.config.min_closed:
            log.warning("breaker of %s stays closed after %d failures: the pool keeps at "
                        "least %d worker(s) closed", url, b.failures, self.config.min_closed)
            return
        self._open(url, b, now)

    def abandon(self, url: str) -> None:
        """A request that ended with no verdict (cancelled, or a 503): frees its trial."""
        b = self.breakers.get(url)
        if b is not None and b.state == HALF_OPEN:
            b.trials = max(0, b.trials - 1)

    def _closed_others(self, pool: Pool, url: str) -> int:
        return sum(1 for e in pool.endpoints.values()
                   if e.url != url and e.available and self.state(e.url) == CLOSED)

    def _open(self, url: str, b: Breaker, now: float) -> None:
        self._move(url, b, OPEN)
        b.opened_at = now
        log.warning("breaker of %s opened for %gs", url, self.config.open_s)

    def _move(self, url: str, b: Breaker, to: str) -> None:
        self.on_transition(url, b.state, to)
        b.state = to

    def forget(self, url: str) -> None:
        self.breakers.pop(url, None)

    # --- retries -----------------------------------------------------------------------------

    def budget(self, pool: Pool) -> RetryBudget:
        budget = self.budgets.get(id(pool))
        if budget is None:
            budget = self.budgets[id(pool)] = RetryBudget(self.config, self.clock)
        return budget

    def backoff(self, retry: int) -> float:
        """Seconds before retry number `retry` (1, 2, ...): exponential, capped, half jittered."""
        if self.config.backoff_s <= 0:
            return 0.0
        delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (retry - 1))
        return delay / 2 + self.rng.uniform(0, delay / 2)


class BreakerCollector(Collector):
    """`sluice_router_breaker_state{worker}`: 0 closed, 1 open, 2 half-open (at scrape)."""

    def __init__(self, breakers: Breakers, pools: Callable[[], list[Pool]]) -> None:
        self.breakers = breakers
        self.pools = pools

    def collect(self) -> Iterator[Metric]:
        fam = GaugeMetricFamily("sluice_router_breaker_state",
                                "circuit breaker: 0 closed, 1 open, 2 half-open",
                                labels=["worker"])
        for pool in self.pools():
            for url in pool.endpoints:
                fam.add_metric([url], STATE_VALUE[self.breakers.state(url)])
        yield fam
