"""`cost` (the default): route to the worker with the smallest estimated time to first token.

    estimate(worker) = overhead(worker)
                     + seconds_per_token(worker) × (work_units(worker, uncached tokens) + 32)

where `uncached = prompt tokens - cached prefix blocks × block_size` (precise KV-event
index when the worker publishes events, else the approximate dispatch index) and
`work_units` adds what is queued ahead of it and the decode pressure of running sequences
(see `sluice.router.endpoints`). `overhead` and `seconds_per_token` are learned per
worker from observed TTFTs (a weighted least-squares line), so a long cached prefix wins exactly while its prefill saving exceeds the extra
queue wait, with no affinity threshold to tune. Cold misses spread because the router's
own in-flight prefill tokens count at once, and exact ties go to the worker with the
smallest cached footprint, then at random.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sluice.router.endpoints import BASE_UNITS, DECODE_EQUIV_TOKENS, EndpointStats, work_units
from sluice.router.policies.base import (
    Choice,
    RequestMeta,
    RoutingPolicy,
    cached,
    footprint,
    pick_min,
)


def uncached_tokens(request: RequestMeta, blocks: int) -> int:
    return max(0, request.num_prompt_tokens - blocks * request.block_size)


def estimate_seconds(request: RequestMeta, e: EndpointStats,
                     decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> float:
    """Estimated seconds until this request's first token on worker `e`."""
    units = work_units(e, uncached_tokens(request, cached(e, True)), decode_equiv_tokens)
    return e.overhead_s + e.seconds_per_token * (units + BASE_UNITS)


class CostModel(RoutingPolicy):
    name = "cost"
    uses_prefix = True

    def __init__(self, rng: random.Random | None = None,
                 decode_equiv_tokens: float = DECODE_EQUIV_TOKENS) -> None:
        super().__init__(rng)
        self.decode_equiv_tokens = decode_equiv_tokens

    def choose(self, request: RequestMeta, endpoints: Sequence[EndpointStats]) -> Choice:
        chosen, best = pick_min(
            endpoints, lambda e: estimate_seconds(request, e, self.decode_equiv_tokens), self.rng,
            then=footprint)
        return Choice(chosen.url, cached(chosen, True), best)
