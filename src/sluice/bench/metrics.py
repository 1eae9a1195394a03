"""From raw request records to the numbers a serving benchmark reports.

Latency statistics (mean, p50, p90, p99, in ms) over successful requests:
TTFT, TPOT (vLLM's: excludes the first token), every ITL, E2E. Throughput is per second
of benchmark duration (first send → last completion). Goodput follows DistServe:
requests per second that met *every* SLO given (`--slo ttft=500ms,tpot=50ms`).

Server-side numbers come from `/metrics` scraped before and after the run: the
prefix-cache hit rate and preemptions *during the run* are deltas of vLLM's counters
(`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
`vllm:num_preemptions_total`; the `_total`-less spellings are accepted, missing
counters give `None`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sluice.bench.client import RequestRecord
from sluice.protocol.errors import InvalidRequestError

SLO_METRICS = ("ttft", "tpot", "e2e")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SLO_RE = re.compile(r"^\s*([a-z0-9_]+)\s*=\s*([0-9.]+(?:e-?[0-9]+)?)\s*(us|ms|s)?\s*$")


def parse_slos(spec: str | None) -> dict[str, float]:
    """`"ttft=500ms,tpot=50ms"` → `{"ttft": 0.5, "tpot": 0.05}` (seconds; bare numbers are ms)."""
    if not spec:
        return {}
    out: dict[str, float] = {}
    for part in spec.split(","):
        m = _SLO_RE.match(part)
        if not m or m.group(1) not in SLO_METRICS:
            raise InvalidRequestError(
                f"bad SLO {part.strip()!r}: expected NAME=VALUE[us|ms|s], NAME in {SLO_METRICS}",
                param="slo",
            )
        out[m.group(1)] = float(m.group(2)) * _UNITS[m.group(3) or "ms"]
    return out


def slo_value(rec: RequestRecord, name: str) -> float:
    value = {"ttft": rec.ttft, "tpot": rec.tpot, "e2e": rec.e2e}[name]
    return 0.0 if value is None else value  # a one-token answer has no TPOT to violate


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    return rec.ok and all(slo_value(rec, k) <= v for k, v in slos.items())


def _stats(name: str, values: Sequence[float]) -> dict[str, float | None]:
    arr = np.asarray(values, dtype=float) * 1000.0
    if arr.size == 0:
        return {f"{s}_{name}_ms": None for s in ("mean", "p50", "p90", "p99")}
    return {
        f"mean_{name}_ms": float(arr.mean()),
        f"p50_{name}_ms": float(np.percentile(arr, 50)),
        f"p90_{name}_ms": float(np.percentile(arr, 90)),
        f"p99_{name}_ms": float(np.percentile(arr, 99)),
    }


def summarize(
    records: Sequence[RequestRecord], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """Aggregate numbers of one run (a flat dict: easy to print, compare and JSON-dump)."""
    ok = [r for r in records if r.ok]
    dur = max(duration, 1e-9)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if r.error)),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "output_throughput": out_tokens / dur,
        "total_token_throughput": (in_tokens + out_tokens) / dur,
    }
    summary |= _stats("ttft", [r.ttft for r in ok if r.ttft is not None])
    summary |= _stats("tpot", [t for r in ok if (t := r.tpot) is not None])
    summary |= _stats("itl", [x for r in ok for x in r.itls])
    summary |= _stats("e2e", [r.e2e for r in ok if r.e2e is not None])
    if slos:
        good = sum(1 for r in records if meets_slos(r, slos))
        summary["slos_ms"] = {k: v * 1000.0 for k, v in slos.items()}
        summary["good_requests"] = good
        summary["goodput"] = good / dur
    return summary


# ---------------------------------------------------------------- /metrics


def _counter(samples: Mapping[str, float], base: str) -> float | None:
    for name in (base + "_total", base):
        if name in samples:
            return samples[name]
    return None


SERVER_COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "num_preemptions": "vllm:num_preemptions",
}


def has_engine_counters(samples: dict[str, float]) -> bool:
    """Whether a scrape holds any of the engine counters the report reads."""
    return any(_counter(samples, base) is not None for base in SERVER_COUNTERS.values())


def server_deltas(before: Mapping[str, Mapping[str, float]] | None,
                  after: Mapping[str, Mapping[str, float]] | None) -> dict[str, float | None]:
    """Counter increases during the run, and the prefix-cache hit rate they imply.

    `before` and `after` map each server scraped (a worker's URL) to its samples. The
    increase is summed over the servers scraped after the run, as Prometheus's
    `increase()` reads counters: a server not scraped before (a worker started during
    the run) or whose counter went down (a restarted worker) counts from 0; one gone by
    the end is not counted. (The sums over all workers before and after were compared,
    so a worker swapped or scaled away during the run made the deltas negative.)"""
    out: dict[str, float | None] = {key: None for key in SERVER_COUNTERS}
    first = before if before is not None else {}
    for url, samples in (after or {}).items() if before is not None else ():  # else unknown
        prev = first.get(url)
        for key, base in SERVER_COUNTERS.items():
            a = _counter(samples, base)
            b = _counter(prev, base) if prev is not None else 0.0
            if a is not None and b is not None:
                out[key] = (out[key] or 0.0) + (a - b if a >= b else a)
    q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = h / q if q and h is not None else None
    return out
