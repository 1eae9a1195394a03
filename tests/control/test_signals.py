"""The planner's inputs: worker latency histograms over a window, and a router pool's sums."""

from __future__ import annotations

import random

import pytest

from sluice.control.signals import (
    LatencySnapshot,
    LatencyWindow,
    histogram_quantile,
    parse_latency,
    pool_signals,
)
from sluice.router.buffer import RequestBuffer
from sluice.router.config import PoolConfig, WorkerSpec
from sluice.router.pool import Pool
from sluice.router.scrape import WorkerLoad


def metrics(le_counts: dict[str, int], itl_sum: float, itl_count: int) -> str:
    lines = ["# TYPE vllm:time_to_first_token_seconds histogram"]
    lines += [f'vllm:time_to_first_token_seconds_bucket{{le="{le}",model_name="m"}} {c}'
              for le, c in le_counts.items()]
    total = max(le_counts.values())
    lines += [f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {total}',
              'vllm:time_to_first_token_seconds_sum{model_name="m"} 1.0',
              "# TYPE vllm:inter_token_latency_seconds histogram",
              f'vllm:inter_token_latency_seconds_sum{{model_name="m"}} {itl_sum}',
              f'vllm:inter_token_latency_seconds_count{{model_name="m"}} {itl_count}',
              'vllm:num_requests_running{model_name="m"} 3']
    return "\n".join(lines) + "\n"


def test_histogram_quantile_interpolates_within_the_bucket() -> None:
    # 10 below 0.1 s, 90 more below 0.5 s: the 90th of 100 lies 80/90 into (0.1, 0.5]
    buckets = [(0.1, 10.0), (0.5, 100.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.1 + 0.4 * 80 / 90)
    assert histogram_quantile(0.9, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.9, [(1.0, 1.0), (float("inf"), 10.0)]) == 1.0  # in +Inf


def test_the_window_differences_each_workers_counters() -> None:
    window = LatencyWindow(window_s=10)
    a0 = parse_latency(metrics({"0.1": 5, "1.0": 5, "+Inf": 5}, 1.0, 10))
    a1 = parse_latency(metrics({"0.1": 5, "1.0": 15, "+Inf": 15}, 3.0, 20))
    assert a1.itl_count == 20 and dict(a1.ttft_buckets)[1.0] == 15
    window.observe("a", 0.0, a0)
    window.observe("a", 5.0, a1)
    window.observe("b", 5.0, a1)  # one snapshot only: nothing observed yet
    assert window.itl_mean() == pytest.approx(2.0 / 10)
    assert window.ttft_p90() == pytest.approx(0.1 + 0.9 * 0.9)  # all 10 new in (0.1, 1]
    window.observe("a", 20.0, a1)  # the old snapshots leave the window: nothing new
    assert window.ttft_p90() is None and window.itl_mean() is None
    window.forget(["b"])
    assert set(window.history) == {"b"}
    assert LatencySnapshot().minus(a1) == LatencySnapshot((), 0.0, 0.0)


def test_pool_signals_sum_the_pools_endpoints() -> None:
    pool = Pool(PoolConfig(workers=(WorkerSpec("http://a:1"), WorkerSpec("http://b:1"),
                                    WorkerSpec("http://c:1"))), random.Random(0))
    a, b, c = pool.endpoints.values()
    b.begin(100, 100, 0.0)  # one of the router's own, prefilling
    c.draining = True
    c.begin(50, 50, 0.0)
    a.load = WorkerLoad(running=2, waiting=0, kv_usage=0.5, prefix_queries=10, prefix_hits=5)
    b.load = WorkerLoad(running=0, waiting=1, kv_usage=0.3, prefix_queries=10, prefix_hits=0)
    s = pool_signals("p", pool, RequestBuffer(8, 1.0), starting=1)
    assert (s.ready, s.starting, s.queued, s.inflight) == (2, 1, 0, 2)
    assert s.kv_usage == pytest.approx(0.4)
    assert s.running == 2 and s.waiting == 2  # a's 2 from others; b's and c's own
    assert s.queued_prefill_tokens == 150
    assert s.prefix_hit_rate == pytest.approx(0.25)
    assert s.seconds_per_token == pool.fit.slope
