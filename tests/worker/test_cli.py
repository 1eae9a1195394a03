"""`sluice worker` / `sluice serve` argument parsing into EngineConfig and WorkerConfig."""

from __future__ import annotations

import pytest

from sluice.cli import build_parser
from sluice.worker.cli import engine_config, worker_config


def parse(*argv: str):  # noqa: ANN201
    return build_parser(list(argv)).parse_args(list(argv))


def test_worker_flags_reach_the_engine_and_worker_configs() -> None:
    args = parse("worker", "--model", "m.gguf", "--port", "9001", "--max-num-seqs", "4",
                 "--block-size", "32", "--no-enable-prefix-caching", "--scheduling-policy",
                 "fcfs", "--max-model-len", "512", "--served-model-name", "a", "b",
                 "--max-pending-requests", "7", "--shutdown-timeout", "2.5",
                 "--kv-events-endpoint", "tcp://127.0.0.1:5557")
    eng = engine_config(args)
    assert eng.model.model == "m.gguf" and eng.model.max_model_len == 512
    assert eng.model.served_model_name == "a"
    assert eng.scheduler.max_num_seqs == 4 and eng.scheduler.scheduling_policy == "fcfs"
    assert eng.cache.block_size == 32 and eng.cache.enable_prefix_caching is False
    assert eng.scheduler.enable_chunked_prefill is True  # untouched: the engine default
    cfg = worker_config(args)
    assert (cfg.port, cfg.served_model_names, cfg.max_pending_requests) == (9001, ("a", "b"), 7)
    assert cfg.shutdown_timeout == 2.5 and cfg.kv_events_endpoint == "tcp://127.0.0.1:5557"


def test_invalid_engine_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("worker", "--block-size", "3")
    assert args.func(args) == 2
    assert "block_size" in capsys.readouterr().out


def test_serve_defaults() -> None:
    args = parse("serve")
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
