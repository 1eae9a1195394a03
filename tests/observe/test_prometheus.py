"""The one Prometheus text reader agrees with prometheus_client's full parser."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sluice.observe.prometheus import sum_samples


def exposition() -> str:
    r = CollectorRegistry()
    g = Gauge("vllm:num_requests_running", "x", ["model_name", "note"], registry=r)
    g.labels("m", 'a "quoted" }{ value \\ with spaces').set(3)
    g.labels("m", "plain").set(2)
    Counter("vllm:prefix_cache_hits", "x", registry=r).inc(10)
    h = Histogram("vllm:e2e_request_latency_seconds", "x", ["model_name"], registry=r,
                  buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 5.0):
        h.labels("m").observe(v)
    Gauge("nan_gauge", "x", registry=r).set(math.inf)
    return generate_latest(r).decode()


def test_sums_match_the_full_parser_on_escaped_labels_and_histograms() -> None:
    text = exposition()
    want: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            want[s.name] = want.get(s.name, 0.0) + s.value
    assert sum_samples(text) == want
    assert want["vllm:num_requests_running"] == 5.0
    assert want["vllm:e2e_request_latency_seconds_count"] == 3.0


def test_timestamps_odd_lines_and_comments() -> None:
    text = ("# HELP a x\n# TYPE a gauge\n"
            'a{l="1"} 1.5 1700000000\n'
            "  a 2\n"
            "broken{l=\"unterminated} 9\n"
            "novalue\n"
            "b NaN-ish\n"
            "c -Inf\n")
    got = sum_samples(text)
    assert got["a"] == 3.5 and got["c"] == -math.inf
    assert set(got) == {"a", "c"}
