"""`sluice worker --kv-offload/--kv-store`: parsed into the engine config, bad values exit 2
naming the flag, and the tiers' series on /metrics (one sample per medium)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sluice.cli import build_parser
from sluice.engine.stats import EngineStats
from sluice.worker.cli import engine_config
from sluice.worker.metrics import EngineStatsCollector


def parse(*argv: str):  # noqa: ANN201
    return build_parser(list(argv)).parse_args(list(argv))


def test_flags_reach_the_cache_config() -> None:
    args = parse("worker", "--kv-offload", "host=4GiB,disk=/tmp/kv:20GiB", "--kv-store",
                 "redis://127.0.0.1:6379/0")
    cache = engine_config(args).cache
    assert cache.kv_offload == "host=4GiB,disk=/tmp/kv:20GiB"
    assert cache.kv_store == "redis://127.0.0.1:6379/0"
    assert engine_config(parse("worker")).cache.kv_offload is None


@pytest.mark.parametrize("flag,value,words", [
    ("--kv-offload", "host=lots", "invalid size 'lots'"),
    ("--kv-offload", "disk=/tmp/kv", "needs DIR:SIZE"),
    ("--kv-offload", "gpu=1GiB", "unknown kv_offload tier 'gpu'"),
    ("--kv-store", "http://x", "unsupported kv_store"),
])
def test_bad_values_exit_2_with_the_reason(flag: str, value: str, words: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("worker", flag, value)
    assert args.func(args) == 2
    assert words in capsys.readouterr().err  # flag errors go to stderr (37e18aa)


def test_tier_series_on_metrics() -> None:
    row = {"hits": 3.0, "queries": 4.0, "bytes_loaded": 300.0, "load_seconds": 0.5,
           "blocks_stored": 9.0, "bytes_stored": 900.0, "errors": 1.0, "usage_bytes": 900.0,
           "hit_tokens": 48.0, "query_tokens": 64.0, "load_s_per_block": 0.001,
           "skipped": 2.0}
    stats = EngineStats(0, 0, 0.0, 8, 0, 0, 0, 0, 0, 0,
                        kv_offload={"CPU": row, "DISK": {**row, "hits": 1.0},
                                    "ENGINE": {"prefill_s_per_block": 0.02,
                                               "write_drops": 5.0, "fetch_misses": 1.0}})
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, lambda: "m"))
    text = generate_latest(registry).decode()
    assert 'vllm:external_prefix_cache_hits_total{medium="CPU",model_name="m"} 48.0' in text
    assert 'sluice:kv_offload_bytes_loaded_total{medium="DISK",model_name="m"} 300.0' in text
    assert 'sluice:kv_offload_errors_total{medium="CPU",model_name="m"} 1.0' in text
    assert 'sluice:kv_offload_prefill_seconds_per_block{model_name="m"} 0.02' in text
    assert 'sluice:kv_offload_skipped_blocks_total{medium="CPU",model_name="m"} 2.0' in text
    assert 'sluice:kv_offload_write_drops_total{model_name="m"} 5.0' in text
    assert 'sluice:kv_offload_fetch_misses_total{model_name="m"} 1.0' in text
    assert 'sluice:kv_offload_prefetch_waits_total{model_name="m"} 0.0' in text
    assert "ENGINE" not in text
