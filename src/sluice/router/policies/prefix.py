"""Prefix-affinity policies: `prefix` (approximate index) and `kv` (engine KV events).

`prefix` follows SGLang's `cache_aware`: longest cached prefix wins, unless the pool is
imbalanced (max load - min load > `balance_abs` and max > `balance_rel` × min), or
nothing matches, in which case the least-loaded worker takes it, so cold misses spread.

`kv` follows llm-d's precise scorer: a weighted sum of scorers, each in [0, 1]:
prefix hit fraction (weight 2), free KV cache (1), short queue (1). A block the worker can
load from a lower KV tier or the shared store counts in the hit fraction less its load
cost (`prefix_index.LOAD_COST_RATIO`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sluice.router.endpoints import EndpointStats
from sluice.router.policies.base import (
    Choice,
    RequestMeta,
    RoutingPolicy,
    cached,
    cached_all,
    effective_cached,
    footprint,
    pick_min_scored,
    reachable,
)
from sluice.router.policies.simple import load_keys


class PrefixAffinity(RoutingPolicy):
    name = "prefix"
    uses_prefix = True
    precise = False

    def __init__(self, rng: random.Random | None = None, balance_abs: float = 32,
                 balance_rel: float = 1.5) -> None:
        super().__init__(rng)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def _imbalanced(self, endpoints: Sequence[EndpointStats]) -> bool:
        loads = [e.running + e.waiting for e in endpoints]  # e.load
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        blocks = cached_all(endpoints, self.precise)
        best_hit = max(blocks)
        if best_hit == 0 or self._imbalanced(endpoints):
            chosen, score = pick_min_scored(endpoints, load_keys(endpoints), self.rng,
                                            then=footprint)
            return Choice(chosen.url, cached(chosen, self.precise), score)
        hits = [e for e, b in zip(endpoints, blocks, strict=True) if b == best_hit]
        chosen, score = pick_min_scored(hits, load_keys(hits), self.rng)
        return Choice(chosen.url, best_hit, score)


class KVAware(RoutingPolicy):
    name = "kv"
    uses_prefix = True

    def __init__(self, rng: random.Random | None = None, prefix_weight: float = 2.0,
                 kv_usage_weight: float = 1.0, queue_weight: float = 1.0) -> None:
        super().__init__(rng)
        self.weights = (prefix_weight, kv_usage_weight, queue_weight)

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        total_blocks = max(1, len(request.block_hashes))
        queues = [e.waiting + e.inflight_tokens * 1e-9 for e in endpoints]
        lo, hi = min(queues), max(queues)
        wp, wk, wq = self.weights
        blocks = [effective_cached(e, True) for e in endpoints]
        # Negated: pick_min wants the best lowest. queue score: 1 if all queues are equal,
        # else (hi - q) / (hi - lo).
        if hi == lo:
            scores = [-(wp * b / total_blocks + wk * (1.0 - e.kv_usage) + wq * 1.0)
                      for e, b in zip(endpoints, blocks, strict=True)]
        else:
            span = hi - lo
            scores = [-(wp * b / total_blocks + wk * (1.0 - e.kv_usage) + wq * ((hi - q) / span))
                      for e, b, q in zip(endpoints, blocks, queues, strict=True)]
        chosen, best = pick_min_scored(endpoints, scores, self.rng)
        return Choice(chosen.url, reachable(chosen, True), -best)
