"""Runtime state of one worker as the router sees it, and the snapshot policies read.

Two views of load are merged here, because each alone is wrong:

- the worker's own gauges, scraped from `/metrics` every ~0.5 s (stale between scrapes,
  but they include traffic from other routers);
- the router's own in-flight accounting, updated at dispatch, at the first byte, and when
  the response (a stream included) ends (exact and immediate, but blind to others).

A request is *prefilling* from dispatch to its first byte and *decoding* after, until its
stream ends. At each scrape, what the worker counts beyond the router's own in-flight
requests is *other* traffic, held until the next scrape; the router's own part stays live:

    others   = max(0, scraped running + scraped waiting - own in flight)   (at the scrape)
    waiting  = own prefilling + others' waiting
    running  = own decoding   + others' running

(Taking `max(scraped, own)` instead kept counting the router's finished requests until
the next scrape: a worker that had just drained looked busy for up to a scrape interval.)

The workers' prefill cost is learned online from the TTFT of streamed responses, as an
exponentially weighted least-squares line (`TTFTFit`) shared by a pool's workers, times
each worker's own speed factor:

    TTFT ≈ speed(worker) × (overhead + seconds_per_token × (work units ahead at dispatch))
    log speed(worker) = EWMA of log(its observed TTFT / the line's prediction),
                        shrunk toward the pool's mean by its own standard error

The line starts from a prior (through the origin until the observed work varies enough
to fit a slope), so the `cost` policy needs no hand-tuned threshold, and a fixed
per-request overhead is not mistaken for a slow prefill. One line from every worker's
TTFTs and one number per worker, rather than a line per worker: two parameters fitted
per worker from a few dozen noisy TTFTs came out 2-3x apart for identical workers, and
`cost` then piled requests onto whichever looked faster; a real difference in speed
(another GPU, a busier host) still shows in the factor.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.router.config import WorkerSpec
from sluice.router.scrape import WorkerLoad

PRIOR_SECONDS_PER_TOKEN = 5e-4  # a small model on a CPU; a GPU learns its way down fast
PRIOR_UNITS = 256.0
BASE_UNITS = 32.0  # fixed per-request work (HTTP, tokenization, one step) in token units
# Weight of each new TTFT (a memory of ~40 requests; 0.2, ~9, let CPU noise through).
EWMA_ALPHA = 0.05
DECODE_EQUIV_TOKENS = 16.0  # prefill-token cost of one running sequence during our wait
MIN_FIT_SPREAD = 64.0  # std-dev of observed units (tokens) needed before fitting a slope
MAX_OVERHEAD_SHARE = 0.5  # of the mean TTFT, at most, is a fixed overhead (TTFTFit.line)
MAX_SPEED_RATIO = 2.0  # a worker's speed factor stays within 1/this..this (Endpoint.speed)


@dataclass
class TTFTFit:
    """Online least squares of TTFT against work units, exponentially weighted.

    Keeps EWMAs of x, y, x², xy; slope = cov(x, y) / var(x). Until x varies by
    MIN_FIT_SPREAD (or if the fitted slope is not positive) the line goes through the
    origin: slope = mean(y) / mean(x), overhead 0. The prior counts as one observation
    and the first ones are plain averages (weight 1/n until it falls to EWMA_ALPHA), so
    a wrong prior is gone after a few TTFTs instead of ~1/EWMA_ALPHA.
    """

    mx: float = PRIOR_UNITS
    my: float = PRIOR_SECONDS_PER_TOKEN * PRIOR_UNITS
    mxx: float = PRIOR_UNITS ** 2
    mxy: float = PRIOR_SECONDS_PER_TOKEN * PRIOR_UNITS ** 2
    n: int = 0
    log_speeds: dict[str, float] = field(default_factory=dict)  # each worker's, by url
    _mean_log_speed: float | None = field(default=None, repr=False, compare=False)

    def set_log_speed(self, url: str, value: float) -> None:
        self.log_speeds[url] = value
        self._mean_log_speed = None

    def forget(self, url: str) -> None:
        self.log_speeds.pop(url, None)
        self._mean_log_speed = None

    def mean_log_speed(self) -> float | None:
        """The workers' mean log speed factor (None before any), kept between changes:
        every candidate of every decision reads it, and summing it each time made a
        decision O(workers²) (20 ms at 1,000 workers; found by `sluice sim`)."""
        if self._mean_log_speed is None and self.log_speeds:
            values = self.log_speeds.values()
            self._mean_log_speed = sum(values) / len(values)
        return self._mean_log_speed

    def observe(self, units: float, seconds: float) -> None:
        x = units + BASE_UNITS
        self.n += 1
        a = max(EWMA_ALPHA, 1.0 / (self.n + 1))
        self.mx += a * (x - self.mx)
        self.my += a * (seconds - self.my)
        self.mxx += a * (x * x - self.mxx)
        self.mxy += a * (x * seconds - self.mxy)

    def _fitted_slope(self) -> float | None:
        var = self.mxx - self.mx ** 2
        if var < MIN_FIT_SPREAD ** 2:
            return None
        slope = (self.mxy - self.mx * self.my) / var
        return slope if slope > 0 else None

    @property
    def slope(self) -> float:
        return self.line()[1]

    @property
    def overhead(self) -> float:
        return self.line()[0]

    def line(self) -> tuple[float, float]:
        """(overhead, slope) at once: one fit for both (a decision reads them per worker).

        The overhead is at most MAX_OVERHEAD_SHARE of the mean TTFT, the line through the
        mean point: a fixed cost per request cannot be most of every TTFT. An overloaded
        worker's TTFTs (waits for a sequence slot, which its queued prefill tokens do not
        measure) fitted a line of ~20 s overhead and a slope near 0, and `cost` then
        stopped seeing queues at all (found by `sluice sim` with a pool grown from one
        worker: one worker took 100+ requests while others stood idle)."""
        fitted = self._fitted_slope()
        if fitted is None:
            return 0.0, self.my / self.mx
        overhead = min(max(0.0, self.my - fitted * self.mx), MAX_OVERHEAD_SHARE * self.my)
        return overhead, (self.my - overhead) / self.mx

    def predict(self, units: float) -> float:
        return self.overhead + self.slope * (units + BASE_UNITS)


@dataclass(slots=True)
class EndpointStats:
    """What a policy may know about one candidate worker for one request (plain data;
    policies read it and do not change it). Slotted, not frozen: one is built per worker
    per decision, and a frozen dataclass's construction costs ~3x (7.7 vs 2.7 us here),
    which at 1,000 workers was most of a decision."""

    url: str
    running: float = 0.0  # running_est
    waiting: float = 0.0  # waiting_est
    kv_usage: float = 0.0
    inflight: int = 0
    inflight_tokens: int = 0
    queued_prefill_tokens: float = 0.0  # uncached prompt tokens of own requests before first byte
    external_waiting: float = 0.0  # waiting requests the router did not send
    mean_prompt_tokens: float = 0.0
    seconds_per_token: float = PRIOR_SECONDS_PER_TOKEN
    overhead_s: float = 0.0  # learned fixed part of the worker's TTFT
    cached_blocks: int = 0  # approximate index (dispatch records)
    kv_cached_blocks: int | None = None  # precise index; None: the worker publishes no events
    cache_footprint: int = 0  # blocks the router has placed there (approximate index)
    # precise index, KV offload: leading blocks after `kv_cached_blocks` the worker can
    # load from its own lower tiers or the shared store, and their load cost in
    # prefill-equivalent blocks (`prefix_index.LOAD_COST_RATIO`)
    kv_tier_blocks: int = 0
    kv_tier_cost: float = 0.0

    @property
    def load(self) -> float:
        return self.running + self.waiting


@dataclass
class Ticket:
    """One dispatched request's accounting, carried from dispatch to the end of its stream."""

    endpoint: Endpoint
    prompt_tokens: int
    uncached_tokens: int
    units: float
    started: float
    first_byte: bool = False
    done: bool = False


@dataclass
class Endpoint:
    """Mutable state of one worker. Owned by its `Pool`; touched only on the event loop."""

    spec: WorkerSpec
    healthy: bool = True
    draining: bool = False
    probed: bool = True  # False: added at runtime, no probe answered yet (`hold_until_probed`)
    models: tuple[str, ...] = ()
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    scraped: WorkerLoad = field(default_factory=WorkerLoad)
    load_at: float = 0.0
    external_running: float = 0.0  # requests the router did not send, as of the last scrape
    external_waiting: float = 0.0
    inflight: int = 0
    inflight_tokens: int = 0
    prefilling: int = 0
    prefill_tokens: float = 0.0
    fit: TTFTFit = field(default_factory=TTFTFit)  # the pool's line (shared by its endpoints)
    log_speed: float = 0.0  # EWMA of log(observed TTFT / the line's prediction)
    log_speed_sq: float = 0.0  # EWMA of its square: the residuals' spread
    speed_samples: int = 0
    prompt_avg: float = 0.0
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    on_finish: Callable[[], None] | None = field(default=None, repr=False)  # the pool's

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def seconds_per_token(self) -> float:
        return self.fit.slope * self.speed

    @property
    def speed(self) -> float:
        """This worker's TTFTs over the pool's line (2.0: twice as slow as the pool's
        average worker), shrunk toward 1 by its own noise (positive-part James-Stein): a
        difference from the other workers no larger than the standard error of its EWMA
        counts as none, so identical workers tie (and cold prefixes spread by cache
        footprint) instead of the one that happened to look faster collecting them.

        Relative to the pool's mean log factor, so the pool's common level lives in the
        line alone: the line learns TTFTs divided by this factor, and a factor that
        carried the level too fed back into the line it is measured against (a
        one-worker pool drifted to speed 0 and a math domain error after ~120k requests;
        found by benchmarks/soak.py).

        Bounded to 1/MAX_SPEED_RATIO..MAX_SPEED_RATIO of the pool's mean: in the first
        minutes of a pool grown under a burst, or on a trace of 15-60k-token prompts, the
        line fits a mix of overloaded and idle workers and the raw factors swung 0.2-14;
        `cost` then piled requests onto a "fast" worker behind a queue of 300k tokens
        (`sluice sim`, Mooncake trace, 1,000 workers: bounded, `cost` went from 0.85 to
        0.97 of the oracle's hit rate, docs/sim.md). Workers of one model's
        pool rarely differ by more than 2x either way; a larger difference still shows,
        as 2x."""
        if not self.speed_samples:  # most of a large pool, most of the time: no call
            return 1.0
        pool_mean = self.fit.mean_log_speed()
        diff = self.log_speed - (self.log_speed if pool_mean is None else pool_mean)
        if not diff:
            return 1.0
        var = max(0.0, self.log_speed_sq - self.log_speed ** 2)
        n_eff = min(float(self.speed_samples), (2.0 - EWMA_ALPHA) / EWMA_ALPHA)
        shrink = max(0.0, 1.0 - var / n_eff / diff ** 2)
        return min(MAX_SPEED_RATIO, max(1.0 / MAX_SPEED_RATIO, math.exp(shrink * diff)))

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    @property
    def load(self) -> WorkerLoad:
        """The worker's gauges as last scraped."""
        return self.scraped

    @load.setter
    def load(self, value: WorkerLoad) -> None:
        """A fresh scrape. What the worker counts beyond the router's own in-flight requests
        *at this moment* is other traffic; that part is held until the next scrape, while the
        router's own counts stay live (a stale gauge must not keep counting requests that
        have since finished)."""
        self.scraped = value
        others = max(0.0, value.running + value.waiting - self.inflight)
        self.external_waiting = min(others, max(0.0, value.waiting - self.prefilling))
        self.external_running = others - self.external_waiting

    def stats(self, cached_blocks: int = 0, kv_cached_blocks: int | None = None,
              cache_footprint: int = 0,
              line: tuple[float, float] | None = None,
              kv_tier: tuple[int, float] = (0, 0.0)) -> EndpointStats:
        """`line`: the pool's (overhead, slope), when the caller has it for every worker."""
        overhead, slope = line if line is not None else self.fit.line()
        speed = self.speed if self.speed_samples else 1.0  # (no call for an unused worker)
        inflight, prefilling, external_waiting = self.inflight, self.prefilling, self.external_waiting
        # Positional, in field order (one of these per worker per decision: keywords cost).
        return EndpointStats(
            self.spec.url,
            inflight - prefilling + self.external_running,  # running
            prefilling + external_waiting,  # waiting
            self.scraped.kv_usage,
            inflight,
            self.inflight_tokens,
            self.prefill_tokens,  # queued_prefill_tokens
            external_waiting,
            self.prompt_avg,  # mean_prompt_tokens
            slope * speed,  # seconds_per_token
            overhead * speed,  # overhead_s
            cached_blocks,
            kv_cached_blocks,
            cache_footprint,
            kv_tier[0],  # kv_tier_blocks
            kv_tier[1],  # kv_tier_cost
        )

    # --- request accounting -------------------------------------------------------------

    def begin(self, prompt_tokens: int, uncached_tokens: int, units: float) -> Ticket:
        """Count a dispatched request as in flight and prefilling."""
        self.inflight += 1
        self.inflight_tokens += prompt_tokens
        self.prefilling += 1
        self.prefill_tokens += uncached_tokens
        self.prompt_avg += EWMA_ALPHA * (prompt_tokens - self.prompt_avg)
        return Ticket(self, prompt_tokens, uncached_tokens, units, self.clock())

    def on_first_byte(self, ticket: Ticket, learn: bool) -> None:
        """The request left prefill; if `learn`, fold its TTFT into the cost estimate."""
        if ticket.first_byte or ticket.done:
            return
        ticket.first_byte = True
        self._end_prefill(ticket)
        if learn:
            self._learn(ticket.units, self.clock() - ticket.started)

    def finish(self, ticket: Ticket) -> None:
        """The response ended (completed, failed or cancelled): stop counting it."""
        if ticket.done:
            return
        if not ticket.first_byte:
            self._end_prefill(ticket)
        ticket.done = True
        self.inflight -= 1
        self.inflight_tokens -= ticket.prompt_tokens
        if self.on_finish is not None:
            self.on_finish()

    def _learn(self, units: float, seconds: float) -> None:
        """Fold one TTFT into the shared line (scaled to speed 1, so that a slow worker does
        not tilt it), then into this worker's speed factor against the updated line."""
        if not 0 < seconds < math.inf:
            return
        self.fit.observe(units, seconds / self.speed)
        predicted = self.fit.predict(units)
        if not 0 < predicted < math.inf:  # a degenerate line learns nothing about speed
            return
        r = math.log(seconds / predicted)
        self.log_speed += EWMA_ALPHA * (r - self.log_speed)
        self.log_speed_sq += EWMA_ALPHA * (r * r - self.log_speed_sq)
        self.speed_samples += 1
        self.fit.set_log_speed(self.url, self.log_speed)

    def _end_prefill(self, ticket: Ticket) -> None:
        self.prefilling -= 1
        self.prefill_tokens = max(0.0, self.prefill_tokens - ticket.uncached_tokens)

    # --- health -------------------------------------------------------------------------

    def record_failure(self, eject_after: int) -> bool:
        """Count a failure; returns True if this one ejected the endpoint."""
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        if self.healthy and self.consecutive_failures >= eject_after:
            self.healthy = False
            return True
        return False

    def hold_until_probed(self) -> None:
        """Take no requests until a health probe answers (a worker added at runtime: it
        may still be starting, or be a mistyped URL); that first answer admits it."""
        self.healthy = self.probed = False

    def record_success(self, readmit_after: int) -> bool:
        """Count a success; returns True if this one re-admitted the endpoint (a worker's
        first answer admits it, which is not a re-admission)."""
        self.consecutive_failures = 0
        self.consecutive_successes += 1
        if not self.probed:
            self.healthy = self.probed = True
            return False
        if not self.healthy and self.consecutive_successes >= readmit_after:
            self.healthy = True
            return True
        return False


def work_units(stats: EndpointStats, uncached_tokens: float,
               decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> float:
    """Prefill-token equivalents a new request waits for on this worker, its own included.

        units = its uncached prompt tokens
              + uncached tokens of the router's requests still in prefill there
              + waiting requests the router did not send × mean prompt length
              + running sequences × decode_equiv_tokens (each shares every step)
    """
    return (uncached_tokens + stats.queued_prefill_tokens
            + stats.external_waiting * stats.mean_prompt_tokens
            + stats.running * decode_equiv_tokens)
