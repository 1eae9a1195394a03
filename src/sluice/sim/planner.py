"""The planner hook: how many workers the simulated pool should have, asked every tick.

The simulator calls `planner.desired_replicas(observation)` every
`planner_interval_s` of virtual time with what an autoscaler can see (queue, running,
KV usage, recent TTFTs, current and starting replicas). A larger answer starts workers
that join the router's pool after `cold_start_s` (model load, warm-up); a smaller one
drains the newest: they take no new requests and leave once idle. Replica-seconds are
counted from a worker's start (cold start included: it is paid for) to its exit.

`FixedPlanner` (the default) holds the pool at its initial size. The production planner
(`sluice.control.planner`, issue 12) plugs in here through the same `ReplicaPlanner`
protocol: add it to `PLANNERS` (or pass an instance to `Simulation`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from sluice.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class PoolObservation:
    """What the pool looks like at one planner tick (plain data, as a planner scrapes)."""

    now: float
    replicas: int  # serving (in the router's pool, not draining)
    starting: int  # started, still in their cold start
    waiting: int  # requests queued in the engines
    running: int  # requests running in the engines
    kv_usage: float  # mean over serving workers, 0..1
    arrivals: int  # requests that arrived since the last tick
    ttft_p90_s: float | None  # over first tokens since the last tick (None: none)


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


PLANNERS: Mapping[str, Callable[[int], ReplicaPlanner]] = MappingProxyType({
    "fixed": FixedPlanner,
})


def make_planner(name: str, initial_replicas: int) -> ReplicaPlanner:
    factory = PLANNERS.get(name)
    if factory is None:
        raise InvalidRequestError(f"unknown planner {name!r}; choose from {sorted(PLANNERS)}",
                                  param="planner")
    return factory(initial_replicas)
