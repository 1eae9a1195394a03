"""`sluice worker` / `sluice serve` argument parsing into EngineConfig and WorkerConfig."""

from __future__ import annotations

import argparse

import pytest

from sluice.cli import build_parser, main
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
    assert "block_size" in capsys.readouterr().err


def test_serve_defaults() -> None:
    args = parse("serve")
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)


@pytest.mark.parametrize("flag", ["--structured-outputs-compile-timeout", "--kv-lease-timeout",
                                  "--kv-transfer-timeout", "--shutdown-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_float_flags_must_be_finite(flag: str, value: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a new-user pass: `--structured-outputs-compile-timeout nan` passed the
    "must be positive" check (nan <= 0 is false) and no compile ever timed out."""
    with pytest.raises(SystemExit) as info:
        parse("worker", flag, value)
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("option", ["structured_outputs_compile_timeout", "kv_lease_timeout",
                                    "kv_transfer_timeout"])
def test_engine_timeouts_must_be_finite(option: str) -> None:
    from sluice.engine.config import EngineConfig
    from sluice.protocol.errors import InvalidRequestError

    for value in (float("nan"), float("inf")):
        with pytest.raises(InvalidRequestError) as info:
            EngineConfig.from_options(None, **{option: value})
        assert info.value.param == option


@pytest.mark.parametrize("flag", ["--max-loras", "--max-lora-rank", "--max-cpu-loras"])
def test_lora_sizes_need_enable_lora(flag: str) -> None:
    """Found by a new-user pass: `--max-loras 2` without `--enable-lora` started a worker
    that served no adapter and said nothing (`--lora-modules` without it is an error)."""
    from sluice.protocol.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as info:
        engine_config(parse("worker", flag, "4"))
    assert info.value.param == flag[2:].replace("-", "_")
    assert "enable_lora" in info.value.message
    assert engine_config(parse("worker", "--enable-lora", flag, "4")).lora.enable_lora


def test_lora_modules_need_enable_lora(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a new-user pass: `--lora-modules a=DIR` without `--enable-lora` loaded the
    model first and then failed with exit 1, where the sizes exit 2 at once."""
    import sluice.worker.server

    started: list[object] = []
    monkeypatch.setattr(sluice.worker.server, "run_worker", lambda *a: started.append(a) or 0)
    args = parse("worker", "--lora-modules", "a=/adapters/a")
    assert args.func(args) == 2 and not started
    assert "enable_lora" in capsys.readouterr().err
    args = parse("worker", "--enable-lora", "--lora-modules", "a=/adapters/a")
    assert args.func(args) == 0 and len(started) == 1


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_each_flag_states_its_default_once(command: str) -> None:
    sub = next(a for a in build_parser([command])._actions
               if isinstance(a, argparse._SubParsersAction))
    helps = [a.help or "" for a in sub.choices[command]._actions]
    assert [h for h in helps if h.count("(default:") > 1] == []


@pytest.mark.parametrize(("argv", "command"), [
    (["serve", "--bogus"], "sluice serve"), (["worker", "--port", "1", "x"], "sluice worker"),
    (["bench", "serve", "--bogus"], "sluice bench serve"),
    (["sim", "calibrate", "--bogus"], "sluice sim calibrate")])
def test_an_unknown_argument_is_refused_with_its_subcommands_usage(
        argv: list[str], command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: {command} [-h]")
    assert f"{command}: error: unrecognized arguments: {argv[-1]}" in err


def test_a_port_in_use_exits_2_before_the_model_loads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the docs new-user pass: `sluice worker --port P` with P taken loaded the
    model, then uvicorn logged 'address already in use' and exited 3 (`sluice serve`
    says so up front, exit 2)."""
    import socket

    import sluice.worker.server

    started: list[object] = []
    monkeypatch.setattr(sluice.worker.server, "run_worker", lambda *a: started.append(a) or 0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args = parse("worker", "--port", str(taken.getsockname()[1]))
        assert args.func(args) == 2 and not started
    captured = capsys.readouterr()
    assert "sluice worker: error: cannot listen on 127.0.0.1:" in captured.err
    assert captured.out == ""
