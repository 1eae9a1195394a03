"""`cost` (the default): route to the worker where the request costs the pool least time.

    cost(worker) = ttft(worker)                          this request's first token
                 + seconds_per_token(worker) × uncached   what its prefill adds to the wait
                                                          of the next request there
    ttft(worker) = overhead(worker)
                 + seconds_per_token(worker) × (work_units(worker, uncached) + 32)

where `uncached = prompt tokens - cached prefix blocks × block_size` (a block the worker
can load from a lower KV tier or the shared store counts as cached, and its load as
`LOAD_COST_RATIO` of its prefill: `prefix_index.TieredKVIndex`; precise KV-event
index when the worker publishes events, else the approximate dispatch index; both hold a
*predicted* entry from the moment a prompt is dispatched, so a prefix still being
prefilled counts as cached there, behind that prefill in the queue) and `work_units` adds
what is queued ahead of it and the decode pressure of running sequences (see
`sluice.router.endpoints`). `overhead` and `seconds_per_token` are learned per worker from
observed TTFTs (a weighted least-squares line).

Why the second term: `ttft` alone is indifferent between waiting behind worker A's
in-flight prefill of a new shared prefix (A's L tokens, then a short suffix) and
recomputing the prefix on an idle worker B (L tokens): a burst of requests sharing a new
prefix then scattered over the pool and computed it once per worker. The uncached
tokens a request leaves on a worker are paid again by whoever is served there next, so
they count twice; a recomputation must now save more queueing than it costs. A long
cached prefix still loses once the extra queue ahead of it exceeds twice its prefill
saving, so a hot worker is shed without any affinity threshold. Cold misses spread
because the router's own in-flight prefill tokens count at once, and exact ties go to
the worker with the smallest cached footprint, then at random.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sluice.router.endpoints import BASE_UNITS, DECODE_EQUIV_TOKENS, EndpointStats, work_units
from sluice.router.policies.base import (
    Choice,
    RequestMeta,
    RoutingPolicy,
    effective_cached,
    footprint,
    pick_min_scored,
    reachable,
)


def uncached_tokens(request: RequestMeta, blocks: int) -> int:
    return max(0, request.num_prompt_tokens - blocks * request.block_size)


def prefill_tokens(request: RequestMeta, e: EndpointStats) -> float:
    """Prompt tokens worker `e` must prefill, a tier or store load priced as a fraction."""
    return max(0.0, request.num_prompt_tokens - effective_cached(e, True) * request.block_size)


def estimate_seconds(request: RequestMeta, e: EndpointStats,
                     decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> float:
    """Estimated seconds until this request's first token on worker `e`."""
    units = work_units(e, prefill_tokens(request, e), decode_equiv_tokens)
    return e.overhead_s + e.seconds_per_token * (units + BASE_UNITS)


def cost_seconds(request: RequestMeta, e: EndpointStats,
                 decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> float:
    """Its TTFT on `e` plus the prefill time it adds ahead of the next request there."""
    return costs(request, (e,), decode_equiv_tokens)[0]


def costs(request: RequestMeta, endpoints: Sequence[EndpointStats],
          decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> list[float]:
    """`cost_seconds` of each of `endpoints`, in one loop: `estimate_seconds` (with
    `effective_cached`, `prefill_tokens` and `work_units`) spelled out, the same operations in the
    same order (the same floats), without five calls per worker per decision."""
    n, bs, base = request.num_prompt_tokens, request.block_size, BASE_UNITS
    out = []
    for e in endpoints:
        kv = e.kv_cached_blocks
        blocks = e.cached_blocks if kv is None else kv + e.kv_tier_blocks - e.kv_tier_cost
        own = max(0.0, n - blocks * bs)
        units = (own + e.queued_prefill_tokens + e.external_waiting * e.mean_prompt_tokens
                 + e.running * decode_equiv_tokens)
        spt = e.seconds_per_token
        out.append(e.overhead_s + spt * (units + base) + spt * own)
    return out


class CostModel(RoutingPolicy):
    name = "cost"
    uses_prefix = True

    def __init__(self, rng: random.Random | None = None,
                 decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> None:
        super().__init__(rng)
        self.decode_equiv_tokens = decode_equiv_tokens

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        chosen, best = pick_min_scored(
            endpoints, costs(request, endpoints, self.decode_equiv_tokens), self.rng,
            then=footprint)
        return Choice(chosen.url, reachable(chosen, True), best)
