"""Latency buckets: fine defaults, a spec that replaces named families, validation."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from sluice.observe.buckets import LatencyBuckets
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.metrics import WorkerMetrics


def test_defaults_resolve_one_millisecond_inter_token_latency() -> None:
    itl = LatencyBuckets().itl
    below_10ms = [b for b in itl if b < 0.01]
    assert itl[0] <= 0.0005 and len(below_10ms) >= 6  # vLLM has none below 10 ms


def test_spec_replaces_only_the_named_families() -> None:
    b = LatencyBuckets.parse("itl=0.001,0.002 ; ttft=0.5,1,2")
    assert b.itl == (0.001, 0.002) and b.ttft == (0.5, 1.0, 2.0)
    assert b.e2e == LatencyBuckets().e2e


def test_environment_then_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_METRICS_BUCKETS", "itl=0.1,0.2;e2e=1,2")
    b = LatencyBuckets.from_env("itl=0.3")
    assert b.itl == (0.3,) and b.e2e == (1.0, 2.0)


@pytest.mark.parametrize("spec", ["itl=0.2,0.1", "itl=0,1", "nope=1", "itl", "itl=a,b",
                                  "itl=nan", "itl=0.001,nan,0.01", "itl=0.1,inf"])
def test_bad_specs_name_the_parameter(spec: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        LatencyBuckets.parse(spec)
    assert err.value.param == "metrics_buckets"


def test_worker_histograms_use_the_configured_buckets() -> None:
    m = WorkerMetrics(lambda: None, lambda: "m", LatencyBuckets.parse("itl=0.001,0.004"))
    m.timer().tokens(1)
    m.itl.labels("m").observe(0.002)
    text = generate_latest(m.registry).decode()
    les = [line.split('le="')[1].split('"')[0] for line in text.splitlines()
           if line.startswith("vllm:inter_token_latency_seconds_bucket")]
    assert les == ["0.001", "0.004", "+Inf"]
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds"):
        assert f"# TYPE {name} histogram" in text


def test_gateway_admission_histogram_uses_the_configured_buckets() -> None:
    from sluice.gateway.metrics import GatewayMetrics

    m = GatewayMetrics(LatencyBuckets.parse("admission=0.0001,0.002"))
    m.overhead.observe(0.001)
    text = generate_latest(m.registry).decode()
    counts = {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines()
              if line.startswith("sluice_gateway_admission_seconds_bucket")}
    assert counts == {"0.0001": 0.0, "0.002": 1.0, "+Inf": 1.0}
