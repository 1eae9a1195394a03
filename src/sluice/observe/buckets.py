"""Histogram buckets for every latency sluice measures, fine by default and configurable.

vLLM's buckets are too coarse for a fast engine: nothing below 10 ms for the
inter-token latency, so a 2 ms ITL and a 9 ms one land in the same bucket and p99 is
pinned at a bucket edge (vLLM issue #34370 asks for configurable buckets). sluice's
defaults start at 0.5 ms for ITL and 1 ms for the request latencies and keep roughly
3 buckets per decade up to hours; any family can be replaced with

    --metrics-buckets 'itl=0.001,0.002,0.005;ttft=0.01,0.1,1'     (worker, router, serve)
    SLUICE_METRICS_BUCKETS='itl=...'                               (the same, from the env)

Names: `ttft`, `itl`, `tpot`, `e2e`, `queue`, `prefill`, `decode`, `inference` (worker),
`decision`, `first_byte` (router), `admission` (gateway); the router's admission-queue
wait uses `queue` too. Bounds are seconds, strictly
increasing, positive and finite; `+Inf` is implicit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from sluice import env
from sluice.protocol.errors import InvalidRequestError

Bounds = tuple[float, ...]

# ~3 per decade (1, 2.5, 5) from 1 ms to 2 h: request-scale latencies
_REQUEST: Bounds = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25,
                    0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0,
                    30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# token-scale: dense between 0.5 ms and 100 ms where decode steps live
_TOKEN: Bounds = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125,
                  0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                  0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
# the router's and the gateway's per-request work: 10 us .. 1 s
_OVERHEAD: Bounds = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                     2.5e-2, 5e-2, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class LatencyBuckets:
    """Upper bounds (seconds) of each latency histogram family."""

    ttft: Bounds = _REQUEST
    itl: Bounds = _TOKEN
    tpot: Bounds = _TOKEN
    e2e: Bounds = _REQUEST
    queue: Bounds = _REQUEST
    prefill: Bounds = _REQUEST
    decode: Bounds = _REQUEST
    inference: Bounds = _REQUEST
    decision: Bounds = _OVERHEAD
    first_byte: Bounds = _REQUEST
    admission: Bounds = _OVERHEAD  # the gateway's arrival -> forwarded

    def __post_init__(self) -> None:
        for f in fields(self):
            bounds = getattr(self, f.name)
            if not bounds or not all(0 < b < math.inf for b in bounds) \
                    or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False)):
                raise InvalidRequestError(
                    f"buckets for {f.name!r} must be positive, finite (+Inf is implicit) "
                    f"and strictly increasing, got {bounds}", param="metrics_buckets")

    @classmethod
    def parse(cls, spec: str | None, base: LatencyBuckets | None = None) -> LatencyBuckets:
        """`base` (default: the defaults) with the families named in `spec` replaced;
        `spec` is `name=b1,b2,...` items separated by `;`. Empty or None: `base`."""
        base = base or cls()
        if not spec or not spec.strip():
            return base
        known = {f.name for f in fields(cls)}
        changes: dict[str, Bounds] = {}
        for item in filter(None, (part.strip() for part in spec.split(";"))):
            name, sep, values = item.partition("=")
            name = name.strip()
            if not sep or name not in known:
                raise InvalidRequestError(
                    f"bad metrics bucket spec {item!r}: want NAME=b1,b2,... with NAME one of "
                    f"{', '.join(sorted(known))}", param="metrics_buckets")
            changes[name] = _floats(values, name)
        return replace(base, **changes)

    @classmethod
    def from_env(cls, flag: str | None = None) -> LatencyBuckets:
        """SLUICE_METRICS_BUCKETS, then `flag` over it (the command line wins)."""
        return cls.parse(flag, cls.parse(env.get("METRICS_BUCKETS")))


def _floats(values: str, name: str) -> Bounds:
    try:
        return tuple(float(v) for v in values.split(",") if v.strip())
    except ValueError:
        raise InvalidRequestError(f"buckets for {name!r} must be numbers, got {values!r}",
                                  param="metrics_buckets") from None
