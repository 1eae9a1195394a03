"""The engine's timestamps become vLLM's queue / prefill / decode histograms and spans."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sluice.engine.outputs import RequestMetrics
from sluice.worker.metrics import WorkerMetrics, request_phases


def _sum(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name + "_sum", {"model_name": "m"})
    return float(value or 0.0)


def test_phases_from_core_timestamps() -> None:
    t = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.25,
                       first_token_time=100.75, finished_time=102.75)
    assert request_phases(t) == (0.25, 0.5, 2.0)
    assert request_phases(RequestMetrics(arrival_time=1.0)) is None  # aborted while queued


def test_histograms_observe_each_phase_and_time_per_output_token() -> None:
    m = WorkerMetrics(lambda: None, lambda: "m")
    t = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0,
                       finished_time=13.0)
    m.timer().engine_times(t, num_output_tokens=5)
    r = m.registry
    assert _sum(r, "vllm:request_queue_time_seconds") == 0.5
    assert _sum(r, "vllm:request_prefill_time_seconds") == 0.5
    assert _sum(r, "vllm:request_decode_time_seconds") == 2.0
    assert _sum(r, "vllm:request_inference_time_seconds") == 2.5
    assert _sum(r, "vllm:request_time_per_output_token_seconds") == 0.5  # 2 s / 4 gaps
