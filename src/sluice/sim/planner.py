"""The planner hook: how many workers the simulated pool should have, asked every tick.

The simulator calls `planner.desired_replicas(observation)` every
`planner_interval_s` of virtual time with what an autoscaler can see (queue, running,
KV usage, recent TTFTs, current and starting replicas, and the production planner's
`PoolSignals`). A larger answer starts workers that join the router's pool after
`cold_start_s` (model load, warm-up); a smaller one cancels starting workers first,
then drains the ready ones with the least in flight (as the production controller
reconciles): they take no new requests and leave once idle. Replica-seconds are
counted from a worker's start (cold start included: it is paid for) to its exit.

    PLANNERS   fixed                 the pool stays at its initial size (FixedPlanner)
               slo | queue | kv      the production planner, `sluice.control.planner.Planner`
                                     with that policy, on the simulator's clock

The production planner runs unchanged: `PoolObservation.signals` is what
`sluice.control.signals.pool_signals` reads from the sim's router `Pool` (the real one)
and from a `LatencyWindow` fed with each simulated worker's cumulative TTFT histogram
and ITL sum/count (`WorkerLatency`: what its `/metrics` would export, with the worker's
bucket bounds), scraped at every tick as the controller scrapes `/metrics`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Protocol

import numpy as np

from sluice.control.planner import POLICIES as CONTROL_POLICIES
from sluice.control.planner import Planner, PlannerConfig, PoolSignals
from sluice.control.signals import LatencySnapshot
from sluice.observe.buckets import LatencyBuckets
from sluice.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class PoolObservation:
    """What the pool looks like at one planner tick (plain data, as a planner scrapes).

    `signals` (the production planner's input) is read on first use: scraping every
    worker's histograms and summing the pool's endpoints costs ~0.1 ms per worker, which
    a fixed pool of 1,000 workers need not pay every tick."""

    now: float
    replicas: int  # serving (in the router's pool, not draining)
    starting: int  # started, still in their cold start
    waiting: int  # requests queued in the engines
    running: int  # requests running in the engines
    kv_usage: float  # mean over serving workers, 0..1
    arrivals: int  # requests that arrived since the last tick
    ttfts: list[float]  # of the first tokens since the last tick, seconds
    read_signals: Callable[[], PoolSignals] = field(repr=False, compare=False)

    @cached_property
    def ttft_p90_s(self) -> float | None:
        """p90 of `ttfts` (None: none), on first use (a fixed pool never asks)."""
        return float(np.percentile(self.ttfts, 90)) if self.ttfts else None

    @cached_property
    def signals(self) -> PoolSignals:
        """`control.signals.pool_signals` on the sim's pool, after scraping the workers."""
        return self.read_signals()


class ReplicaPlanner(Protocol):
    """Decides the pool size. Called from the event loop only; may keep its own state."""

    def desired_replicas(self, obs: PoolObservation) -> int: ...


@dataclass
class FixedPlanner:
    """Always the same number of workers (a pool sized by hand, or for the peak)."""

    replicas: int

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InvalidRequestError("replicas must be >= 1", param="workers")

    def desired_replicas(self, obs: PoolObservation) -> int:
        return self.replicas


class ControlPlanner:
    """The production planner (`sluice.control.planner.Planner`) in virtual time: each
    tick is one `Planner.decide(signals, now)`, its `desired` the answer."""

    def __init__(self, config: PlannerConfig, initial: int) -> None:
        if config.min_replicas < 1:
            raise InvalidRequestError("the simulator holds no requests while a pool is at "
                                      "zero workers: --min-workers must be >= 1",
                                      param="min_workers")
        self.planner = Planner(config, initial=initial)

    def desired_replicas(self, obs: PoolObservation) -> int:
        return self.planner.decide(obs.signals, obs.now).desired


@dataclass
class WorkerLatency:
    """One simulated worker's cumulative `vllm:time_to_first_token_seconds` histogram and
    `vllm:inter_token_latency_seconds` sum/count, as its `/metrics` exports them (the
    worker's default bucket bounds)."""

    bounds: tuple[float, ...] = LatencyBuckets().ttft
    counts: list[int] = field(default_factory=list)  # per bucket, +Inf last
    itl_sum: float = 0.0
    itl_count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe_ttft(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1  # le is inclusive

    def observe_itl(self, seconds: float) -> None:
        self.itl_sum += seconds
        self.itl_count += 1

    def snapshot(self) -> LatencySnapshot:
        cumulative, total = [], 0
        for le, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            cumulative.append((le, float(total)))
        return LatencySnapshot(tuple(cumulative), self.itl_sum, float(self.itl_count))


PlannerFactory = Callable[[int, PlannerConfig], ReplicaPlanner]


def _fixed(initial: int, config: PlannerConfig) -> ReplicaPlanner:
    return FixedPlanner(initial)


def _control(policy: str) -> PlannerFactory:
    def make(initial: int, config: PlannerConfig) -> ReplicaPlanner:
        return ControlPlanner(replace(config, policy=policy), initial)
    return make


PLANNERS: Mapping[str, PlannerFactory] = MappingProxyType({
    "fixed": _fixed, **{name: _control(name) for name in CONTROL_POLICIES}})


def make_planner(name: str, initial: int, config: PlannerConfig | None = None
                 ) -> ReplicaPlanner:
    """`name` from `PLANNERS`, starting at `initial` workers; `config` (bounds, SLO,
    delays) is the production planner's and is unused by `fixed`."""
    factory = PLANNERS.get(name)
    if factory is None:
        raise InvalidRequestError(f"unknown planner {name!r}; choose from {sorted(PLANNERS)}",
                                  param="planner")
    return factory(initial, config or PlannerConfig(min_replicas=1, max_replicas=initial))
