"""Load-only policies: `round_robin`, `least_load`, and `session` affinity."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from operator import attrgetter

from sluice.router.endpoints import EndpointStats
from sluice.router.policies.base import Choice, RequestMeta, RoutingPolicy, pick_min_scored


class RoundRobin(RoutingPolicy):
    """Each available worker in turn (ordered by URL, so the order is stable)."""

    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._next = 0

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        ordered = sorted(endpoints, key=_url)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Choice(chosen.url)


_url = attrgetter("url")


def load_key(e: EndpointStats) -> float:
    """Requests on the worker, ties broken by in-flight prompt tokens."""
    return e.load + e.inflight_tokens * 1e-9


def load_keys(endpoints: Sequence[EndpointStats]) -> list[float]:
    """`load_key` of each of `endpoints` (`load` spelled out: the same sum, no calls)."""
    return [e.running + e.waiting + e.inflight_tokens * 1e-9 for e in endpoints]


class LeastLoad(RoutingPolicy):
    """Fewest running + waiting requests (the larger of scraped and own counts)."""

    name = "least_load"

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        chosen, best = pick_min_scored(endpoints, load_keys(endpoints), self.rng)
        return Choice(chosen.url, score=best)


def _affinity(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest(), "big")


class Session(RoutingPolicy):
    """Same session, same worker: rendezvous hashing on the session key.

    The key is the `x-session-id` header or the request's `user` field. Rendezvous
    (highest-random-weight) hashing is consistent: when a worker leaves, only its sessions
    move, and they come back when it returns. Requests without a key go to the least
    loaded worker.
    """

    name = "session"

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        if request.session_key is None:
            chosen, best = pick_min_scored(endpoints, load_keys(endpoints), self.rng)
            return Choice(chosen.url, score=best)
        key = request.session_key
        chosen = max(endpoints, key=lambda e: _affinity(key, e.url))
        return Choice(chosen.url)
