"""Arrival processes, SLO parsing, aggregation, goodput, and `/metrics` deltas."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

from sluice.bench.client import RequestRecord
from sluice.bench.load import LoadConfig, arrival_times
from sluice.bench.metrics import meets_slos, parse_slos, server_deltas, summarize
from sluice.observe.prometheus import sum_samples
from sluice.protocol.errors import InvalidRequestError


def _gaps(rate: float, burstiness: float, seed: int, n: int = 4000) -> list[float]:
    times = list(itertools.islice(arrival_times(rate, burstiness, seed), n))
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_arrivals_have_the_right_mean_and_spread() -> None:
    gaps = _gaps(rate=8.0, burstiness=1.0, seed=0)
    assert statistics.mean(gaps) == pytest.approx(1 / 8, rel=0.05)
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1


def test_burstiness_changes_spread_not_mean() -> None:
    bursty, regular = _gaps(4.0, 0.25, 1), _gaps(4.0, 4.0, 1)
    assert statistics.mean(bursty) == pytest.approx(0.25, rel=0.1)
    assert statistics.mean(regular) == pytest.approx(0.25, rel=0.05)
    cv = lambda g: statistics.pstdev(g) / statistics.mean(g)  # noqa: E731
    assert cv(bursty) == pytest.approx(2.0, rel=0.15) and cv(regular) == pytest.approx(0.5, rel=0.1)


def test_arrivals_are_seeded_and_inf_is_all_at_once() -> None:
    assert _gaps(5, 1, 3, 50) == _gaps(5, 1, 3, 50)
    assert _gaps(5, 1, 3, 50) != _gaps(5, 1, 4, 50)
    assert list(itertools.islice(arrival_times(math.inf, 1.0, 0), 5)) == [0.0] * 5


def test_load_config_validation() -> None:
    for bad in ({"request_rate": 0}, {"burstiness": -1}, {"max_concurrency": 0}, {"duration": 0},
                {"request_rate": math.nan}, {"burstiness": math.nan}, {"burstiness": math.inf},
                {"duration": math.nan}, {"duration": math.inf}):
        with pytest.raises(InvalidRequestError) as e:
            LoadConfig(**bad)  # type: ignore[arg-type]
        assert e.value.param == next(iter(bad))


def test_parse_slos() -> None:
    assert parse_slos("ttft=500ms, tpot=50ms,e2e=2s") == {"ttft": 0.5, "tpot": 0.05, "e2e": 2.0}
    assert parse_slos("ttft=250") == {"ttft": 0.25}
    assert parse_slos(None) == {}
    for bad in ("latency=5ms", "ttft=fast", "ttft"):
        with pytest.raises(InvalidRequestError) as e:
            parse_slos(bad)
        assert e.value.param == "slo"


def _rec(ttft: float, itls: list[float], error: str | None = None, prompt: int = 10) -> RequestRecord:
    e2e = ttft + sum(itls)
    return RequestRecord(0, 0, 0.0, prompt, len(itls) + 1, ttft=ttft, e2e=e2e, itls=itls,
                         prompt_tokens=prompt, output_tokens=len(itls) + 1, error=error)


def test_summary_statistics_and_goodput() -> None:
    recs = [_rec(0.1 * (i + 1), [0.01 * (i + 1)] * 4) for i in range(10)]  # TTFT .1...1.0, TPOT 10..100ms
    recs.append(_rec(0.05, [0.01], error="http_503"))
    s = summarize(recs, duration=2.0, slos={"ttft": 0.5, "tpot": 0.03})
    assert s["completed"] == 10 and s["failed"] == 1 and s["errors"] == {"http_503": 1}
    assert s["mean_ttft_ms"] == pytest.approx(550.0)
    assert s["p50_ttft_ms"] == pytest.approx(float(np.percentile([100 * (i + 1) for i in range(10)], 50)))
    assert s["p99_tpot_ms"] == pytest.approx(float(np.percentile([10 * (i + 1) for i in range(10)], 99)))
    assert s["mean_itl_ms"] == pytest.approx(55.0)
    assert s["total_output_tokens"] == 50 and s["output_throughput"] == pytest.approx(25.0)
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["good_requests"] == 3 and s["goodput"] == pytest.approx(1.5)  # i = 0, 1, 2
    assert not meets_slos(recs[-1], {"ttft": 1.0})  # a failed request is never good


def test_one_token_answers_have_no_tpot() -> None:
    r = _rec(0.2, [])
    assert r.tpot is None and meets_slos(r, {"tpot": 0.001, "ttft": 0.3})
    assert summarize([r], 1.0)["mean_tpot_ms"] is None


PROM = """# HELP vllm:prefix_cache_queries_total queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100.0
vllm:prefix_cache_queries_total{model_name="m",engine="1"} 50.0
vllm:prefix_cache_hits_total{model_name="m"} 30.0
vllm:num_preemptions_total{model_name="m"} 2
vllm:num_requests_running 3
vllm:kv_cache_usage_perc{model_name="a b}c"} 0.5 1700000000
"""


def test_sum_samples_sums_label_sets() -> None:
    p = sum_samples(PROM)
    assert p["vllm:prefix_cache_queries_total"] == 150.0
    assert p["vllm:num_requests_running"] == 3.0
    assert p["vllm:kv_cache_usage_perc"] == 0.5


def test_server_deltas_with_and_without_total_suffix() -> None:
    before = sum_samples(PROM)
    after = sum_samples(PROM.replace("100.0", "300.0").replace("30.0", "130.0").replace(" 2\n", " 5\n"))
    d = server_deltas({"w": before}, {"w": after})
    assert d == {"prefix_cache_queries": 200.0, "prefix_cache_hits": 100.0, "num_preemptions": 3.0,
                 "prefix_cache_hit_rate": 0.5}
    bare = {k.removesuffix("_total"): v for k, v in before.items()}
    bare_after = {k.removesuffix("_total"): v for k, v in after.items()}
    assert server_deltas({"w": bare}, {"w": bare_after}) == d


def test_server_deltas_over_workers_that_came_went_or_restarted_during_the_run() -> None:
    """A worker scaled away, swapped or restarted during a run: each worker's increase,
    as Prometheus's increase() (the sums over the workers made the deltas negative)."""
    def c(q: float, h: float) -> dict[str, float]:
        return {"vllm:prefix_cache_queries_total": q, "vllm:prefix_cache_hits_total": h}

    before = {"a": c(100, 50), "b": c(5000, 300), "r": c(400, 40)}
    after = {"a": c(160, 80), "n": c(20, 5), "r": c(30, 3)}  # b gone, n new, r restarted
    d = server_deltas(before, after)
    assert d["prefix_cache_queries"] == 60 + 20 + 30 and d["prefix_cache_hits"] == 30 + 5 + 3
    assert d["prefix_cache_hit_rate"] == 38 / 110


def test_server_deltas_tolerate_missing_metrics() -> None:
    assert server_deltas(None, None) == {"prefix_cache_queries": None, "prefix_cache_hits": None,
                                         "num_preemptions": None, "prefix_cache_hit_rate": None}
    only = {"vllm:num_preemptions_total": 1.0}
    d = server_deltas({"w": only}, {"w": {"vllm:num_preemptions_total": 4.0}})
    assert d["num_preemptions"] == 3.0 and d["prefix_cache_hit_rate"] is None


def test_every_plot_panel_draws_a_run_shorter_than_a_second(tmp_path: Path) -> None:
    """A 0.5 s run has one throughput bin, and one request one point per CDF: drawn as a
    bare line through one point, those panels were empty in the PNG."""
    from sluice.bench.report import figure, plot

    rec = _rec(0.1, [0.02] * 4)
    rec.token_times = [0.1, 0.12, 0.14, 0.16, 0.18]
    fig = figure([("http://a", [rec])])
    for ax in fig.axes:
        (line,) = ax.get_lines()
        assert len(line.get_xdata()) >= 2 or line.get_marker() not in (None, "None", "", " ")
    plot(tmp_path / "out.png", [("http://a", [rec])])
    assert (tmp_path / "out.png").stat().st_size > 0
