"""Read the few load numbers the router needs from a worker's Prometheus `/metrics`.

The router sums the samples of a handful of gauges, whatever their labels, with the
one Prometheus text reader (`sluice.observe.prometheus`). vLLM's names come first; SGLang's are
accepted as synonyms so its servers work as workers unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.observe.prometheus import sum_samples

# our field -> metric names that provide it (first found wins)
_SOURCES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"),
    "prefix_hits": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"),
}


@dataclass(frozen=True)
class WorkerLoad:
    """One scrape's worth of a worker's own view of its load."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0


def parse_load(text: str) -> WorkerLoad:
    """The load fields found in `text`; absent metrics read as 0."""
    samples = sum_samples(text)
    found: dict[str, float] = {}
    for field_name, names in _SOURCES.items():
        for name in names:
            if name in samples:
                found[field_name] = samples[name]
                break
    return WorkerLoad(**found)
