"""The routing-policy contract: plain data in, one worker out.

A policy sees a `RequestMeta` (what the router knows about the request: token count,
block hashes, session key) and the `EndpointStats` of the available workers of the
chosen group (healthy, not draining, not already tried for this request), and returns a
`Choice`. It never sees an HTTP request, never does I/O, and keeps only its own small
state (a round-robin counter). Randomness comes from the injected `random.Random`, so a
seeded router makes the same choices for the same inputs.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from sluice.router.endpoints import EndpointStats

EPSILON = 1e-12


@dataclass(frozen=True)
class RequestMeta:
    """What a policy may know about a request."""

    model: str
    num_prompt_tokens: int = 0
    block_hashes: tuple[int, ...] = ()
    session_key: str | None = None
    max_tokens: int | None = None
    block_size: int = 16
    version: str = "baseline"  # the release version whose workers may serve it (release.py)


@dataclass(frozen=True)
class Choice:
    """A policy's answer: the worker, the prefix blocks it expects cached, its score."""

    url: str
    cached_blocks: int = 0
    score: float = 0.0


class RoutingPolicy(ABC):
    """Picks one of `endpoints` (never empty) for `request`.

    `uses_prefix`: the router must compute the request's block hashes and fill
    `cached_blocks` / `kv_cached_blocks` before calling `choose`.
    """

    name: ClassVar[str]
    uses_prefix: ClassVar[bool] = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @abstractmethod
    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        """Return the chosen endpoint. Mutates only the policy's own counters."""


def pick_min(endpoints: Sequence[EndpointStats], key: Callable[[EndpointStats], float],
             rng: random.Random, then: Callable[[EndpointStats], float] | None = None
             ) -> tuple[EndpointStats, float]:
    """The endpoint with the smallest `key`; ties go to the smallest `then` (if given),
    remaining ties uniformly at random by `rng`."""
    return pick_min_scored(endpoints, list(map(key, endpoints)), rng, then)


def pick_min_scored(endpoints: Sequence[EndpointStats], scores: Sequence[float],
                    rng: random.Random, then: Callable[[EndpointStats], float] | None = None
                    ) -> tuple[EndpointStats, float]:
    """`pick_min` with each endpoint's key already computed (`scores`, in the same order):
    a policy that scores the whole pool in one expression saves a call per worker."""
    best = min(scores)
    limit = best + EPSILON * max(1.0, abs(best))
    tied = [e for s, e in zip(scores, endpoints, strict=True) if s <= limit]
    if then is not None and len(tied) > 1:
        low = min(then(e) for e in tied)
        tied = [e for e in tied if then(e) <= low]
    return (tied[0] if len(tied) == 1 else rng.choice(tied)), best


def footprint(e: EndpointStats) -> float:
    """Tie-break for cold requests: the worker holding the fewest cached blocks, so that the
    pool's working set spreads over all caches instead of piling onto one."""
    return float(e.cache_footprint)


def cached(e: EndpointStats, precise: bool) -> int:
    """The cached-prefix blocks to trust: precise (KV events) when the worker has them."""
    if precise and e.kv_cached_blocks is not None:
        return e.kv_cached_blocks
    return e.cached_blocks


def cached_all(endpoints: Sequence[EndpointStats], precise: bool) -> list[int]:
    """`cached(e, precise)` of each of `endpoints`, in one loop."""
    if not precise:
        return [e.cached_blocks for e in endpoints]
    return [e.cached_blocks if e.kv_cached_blocks is None else e.kv_cached_blocks
            for e in endpoints]


def reachable(e: EndpointStats, precise: bool) -> int:
    """`cached`, plus (precise) the blocks after them that `e` can load from its own
    lower KV tiers or the shared store: the prefix it will not recompute."""
    if precise and e.kv_cached_blocks is not None:
        return e.kv_cached_blocks + e.kv_tier_blocks
    return e.cached_blocks


def effective_cached(e: EndpointStats, precise: bool) -> float:
    """`reachable` less the loads' cost in prefill-equivalent blocks: a block in a
    lower tier or the store counts as cached-but-cheaper-than-none."""
    if precise and e.kv_cached_blocks is not None:
        return e.kv_cached_blocks + e.kv_tier_blocks - e.kv_tier_cost
    return float(e.cached_blocks)
