"""`sluice serve`'s autoscaling flags: bounds, SLO and backend errors exit 2 before
anything starts; the planner config they make."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sluice.cli import build_parser, main
from sluice.control.planner import SLO
from sluice.protocol.errors import InvalidRequestError
from sluice.serve import planner_config, uses_router, worker_bounds


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(["serve"]).parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--min-workers", "3", "--max-workers", "2"], "--min-workers must be <= --max-workers (2), got 3"),
    (["--min-workers", "-1"], "--min-workers must be >= 0, got -1"),
    (["--max-workers", "0"], "--max-workers must be >= 1, got 0"),
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--min-workers", "1", "--slo", "p99=1s"], "--slo: expected ttft=..,itl=.., got 'p99=1s'"),
    (["--min-workers", "1", "--slo", "ttft=fast"], "--slo: expected a duration like 2s or 200ms"),
    (["--min-workers", "1", "--slo", "itl=0ms"], "--slo: itl must be a finite number > 0"),
    (["--backend", "external"], "--worker-url"),
    (["--worker-url", "http://w:1", "--workers", "2"], "--worker-url"),
    (["--worker-dns", "http://w:1", "--workers", "2"], "--worker-dns go with --backend external"),
    (["--backend", "external", "--worker-dns", "w:8000"],
     "a discovered worker URL is http(s)://NAME[:PORT], got 'w:8000'"),
    # each message names the flag typed, one check per flag (not the config's fields)
    (["--max-workers", "2", "--lookahead", "-1"], "--lookahead must be >= 0, got -1"),
    (["--max-workers", "2", "--scale-up-delay", "-2"], "--scale-up-delay must be >= 0, got -2"),
    (["--max-workers", "2", "--scale-down-delay", "-1"],
     "--scale-down-delay must be >= 0, got -1"),
    (["--max-workers", "2", "--max-step-down", "0"], "--max-step-down must be >= 1, got 0"),
    (["--max-workers", "2", "--scale-down-margin", "1.5"],
     "--scale-down-margin must be in (0, 1], got 1.5"),
    (["--max-workers", "2", "--target-ongoing-requests", "0"],
     "--target-ongoing-requests must be > 0, got 0"),
    (["--max-workers", "2", "--target-kv-usage", "1.2"], "--target-kv-usage must be in (0, 1]"),
    (["--max-workers", "2", "--target-queue-length", "0"], "--target-queue-length must be > 0"),
    (["--min-workers", "0", "--max-workers", "2", "--scale-to-zero-after", "-1"],
     "--scale-to-zero-after must be >= 0, got -1"),
    (["--max-workers", "2", "--buffer-timeout", "-1"], "--buffer-timeout must be >= 0, got -1"),
    # a NaN or an infinity means nothing here (`--scale-up-delay nan`: never scale up)
    (["--max-workers", "2", "--lookahead", "nan"], "--lookahead must be a finite number, got nan"),
    (["--max-workers", "2", "--scale-up-delay", "nan"], "--scale-up-delay must be a finite"),
    (["--max-workers", "2", "--target-ongoing-requests", "inf"],
     "--target-ongoing-requests must be a finite number, got inf"),
    (["--max-workers", "2", "--buffer-timeout", "nan"], "--buffer-timeout must be a finite"),
    (["--max-workers", "2", "--drain-timeout", "inf"], "--drain-timeout must be a finite"),
    # the controller's own setting, checked before anything starts (it was a traceback)
    (["--min-workers", "1", "--max-workers", "2", "--drain-timeout", "-1"],
     "--drain-timeout must be >= 0, got -1"),
    # contradictions name the flags given
    (["--workers", "2", "--min-workers", "1", "--max-workers", "3"],
     "--workers fixes the pool size: it cannot be combined with --min-workers/--max-workers"),
    (["--workers", "4", "--max-workers", "2"], "--workers fixes the pool size"),
    (["--min-workers", "1", "--max-workers", "2", "--scale-to-zero-after", "10"],
     "--scale-to-zero-after needs --min-workers 0"),
    (["--workers", "2", "--scale-to-zero-after", "10"], "--scale-to-zero-after needs"),
    (["--scale-to-zero-after", "10"], "--scale-to-zero-after needs --min-workers 0"),
    # nothing is held for the planner to see, so a pool at zero never woke (all 503)
    (["--min-workers", "0", "--max-workers", "2", "--buffer-timeout", "0"],
     "--buffer-timeout 0 answers 503 at once and holds no request, so a pool at zero "
     "would never wake"),
])
def test_bad_flags_exit_2_before_starting(argv: list[str], message: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--no-gateway", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "_s " not in err and "replicas" not in err  # no config field names


def test_bounds_and_the_planner_config() -> None:
    assert worker_bounds(parse()) == (1, 1) and not uses_router(parse())
    assert worker_bounds(parse("--workers", "3")) == (3, 3) and uses_router(parse("--workers", "3"))
    args = parse("--min-workers", "0", "--max-workers", "3", "--slo", "ttft=1s,itl=50ms",
                 "--scale-to-zero-after", "30", "--planner-policy", "queue")
    config = planner_config(args)
    assert (config.min_replicas, config.max_replicas, config.policy) == (0, 3, "queue")
    assert config.slo == SLO(1.0, 0.05) and config.scale_to_zero_after_s == 30
    assert planner_config(parse("--min-workers", "1", "--max-workers", "2")) \
        .scale_to_zero_after_s is None
    assert planner_config(parse("--min-workers", "0", "--max-workers", "2")) \
        .scale_to_zero_after_s == 300.0  # the default, with --min-workers 0 only
    assert worker_bounds(parse("--max-workers", "3")) == (1, 3)
    assert worker_bounds(parse("--min-workers", "2")) == (2, 2)
    assert planner_config(parse("--max-workers", "2")).lookahead_s == 30.0
    assert planner_config(parse("--max-workers", "2", "--lookahead", "0")).lookahead_s == 0.0
    tuned = planner_config(parse("--max-workers", "2", "--scale-up-delay", "1",
                                 "--scale-down-delay", "9", "--scale-down-margin", "0.8"))
    assert (tuned.scale_up_delay_s, tuned.scale_down_delay_s, tuned.scale_down_margin) \
        == (1.0, 9.0, 0.8)
    assert (tuned.target_ongoing_requests, tuned.target_kv_usage, tuned.target_queue_length) \
        == (8.0, 0.8, 5.0)  # the defaults
    queue = planner_config(parse("--max-workers", "2", "--planner-policy", "queue",
                                 "--target-ongoing-requests", "16"))
    kv = planner_config(parse("--max-workers", "2", "--planner-policy", "kv",
                              "--target-kv-usage", "0.7", "--target-queue-length", "3"))
    assert (queue.target_ongoing_requests, kv.target_kv_usage, kv.target_queue_length) \
        == (16.0, 0.7, 3.0)
    # a setting only another policy reads was taken and never read: now a 400 naming it
    for policy, flag, value in [("slo", "--target-kv-usage", "0.5"),
                                ("queue", "--scale-down-margin", "0.9"),
                                ("kv", "--lookahead", "10"),
                                ("slo", "--target-ongoing-requests", "12")]:
        with pytest.raises(InvalidRequestError) as err:
            planner_config(parse("--max-workers", "2", "--planner-policy", policy, flag, value))
        assert err.value.param == flag[2:].replace("-", "_")
        assert str(err.value).startswith(f"{flag} is read by the ") and f"not by {policy}" \
            in str(err.value)


def test_chat_flags_reach_every_worker(tmp_path: object) -> None:
    """`--tool-call-parser`, `--reasoning-parser` and `--chat-template` (as an absolute
    path: they start in another directory) go to the worker processes; without them the
    workers use the defaults."""
    from pathlib import Path

    from sluice.serve import worker_flags

    template = Path(str(tmp_path)) / "t.jinja"
    template.write_text("{{ messages }}")
    flags = worker_flags(parse("--workers", "2", "--chat-template", str(template),
                               "--reasoning-parser", "qwen3"))
    assert flags[flags.index("--tool-call-parser") + 1] == "hermes"
    assert flags[flags.index("--chat-template") + 1] == str(template.resolve())
    assert flags[flags.index("--reasoning-parser") + 1] == "qwen3"
    plain = worker_flags(parse("--workers", "2"))
    assert "--chat-template" not in plain and "--reasoning-parser" not in plain


def test_local_workers_split_the_machines_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each local worker gets cores / (most workers at once) threads, at least 1; a given
    `--cpu-threads` or a non-local backend is left alone."""
    import os

    from sluice.serve import local_cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    assert local_cpu_threads(parse("--workers", "2"), 2) == ["--cpu-threads", "4"]
    assert local_cpu_threads(parse("--min-workers", "1", "--max-workers", "3"), 3) \
        == ["--cpu-threads", "2"]
    assert local_cpu_threads(parse("--workers", "16"), 16) == ["--cpu-threads", "1"]
    assert local_cpu_threads(parse("--workers", "2", "--cpu-threads", "3"), 2) == []
    assert local_cpu_threads(parse("--workers", "2", "--backend", "ray"), 2) == []
    from sluice.serve import worker_flags

    given = worker_flags(parse("--workers", "2", "--cpu-threads", "3"))
    assert given[given.index("--cpu-threads") + 1] == "3"


def test_flag_errors_carry_the_flag_as_param() -> None:
    from sluice.protocol.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as exc:
        planner_config(parse("--max-workers", "2", "--scale-down-delay", "-1"))
    assert exc.value.param == "scale_down_delay"
    from sluice.serve import controller_config

    with pytest.raises(InvalidRequestError) as exc:
        controller_config(parse("--max-workers", "2", "--drain-timeout", "-1"))
    assert exc.value.param == "drain_timeout"
    assert controller_config(parse("--drain-timeout", "5")).drain_grace_s == 5.0


def test_help_states_the_real_model_default(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model`'s default is the bundled GGUF, served (and its pool named) as
    SmolLM2-135M-Instruct.Q4_1, not a name `--model` could not load."""
    from sluice.engine.tokenizer import default_served_name

    monkeypatch.setenv("COLUMNS", "400")  # no line breaks inside the names
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "bundled SmolLM2-135M-Instruct Q4_1 GGUF" in help_text
    assert f"served as {default_served_name(None)}" in help_text


@pytest.mark.parametrize("argv", [
    ["--workers", "2"],  # would start two workers first
    ["--backend", "external", "--worker-url", "http://127.0.0.1:1", "--min-workers", "0",
     "--max-workers", "1"],  # a router only: it was OSError's traceback once started
    [],  # one worker in this process
])
def test_a_port_in_use_exits_2_before_anything_starts(argv: list[str],
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--no-gateway", "--port", str(port), *argv]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "starting" not in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must be in 0..65535, got 70000"),
    (["--host", "nohost.invalid"], "--host 'nohost.invalid': cannot resolve it"),
])
def test_a_bad_address_exits_2(argv: list[str], message: str,
                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--no-gateway", "--workers", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_pool_whose_workers_all_fail_to_start_exits_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """A model that is found but does not load (a corrupt GGUF, a flag the worker
    refuses): `sluice serve --workers 2` listened with no worker, answered 503 after
    the buffer timeout and started a doomed worker every second. Now it exits 1 with
    the worker's error, and without asyncio's never-retrieved traceback."""
    import gc

    from control.stub_backend import StubBackend
    from sluice.engine.tokenizer import resolve_model

    broken = frozenset({str(resolve_model(None))})
    monkeypatch.setattr("sluice.control.backend.make_backend",
                        lambda name, **_: StubBackend(broken=broken))
    assert main(["serve", "--no-gateway", "--workers", "2", "--port", "0"]) == 1
    gc.collect()
    err = capsys.readouterr().err
    assert ("sluice serve: error: no worker of pool SmolLM2-135M-Instruct.Q4_1 started: "
            "worker exited with 1: cannot load") in err
    assert "Traceback" not in err and "never retrieved" not in caplog.text


def test_flag_errors_come_before_the_port_check(capsys: pytest.CaptureFixture[str]) -> None:
    """A flag mistake is reported as such whatever the port: with the port checked
    first, `--backend external` without `--worker-url` said 'cannot listen' where 8000
    was taken (the flag tests failed on a machine with a server on 8000)."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert main(["serve", "--no-gateway", "--port", port, "--backend", "external"]) == 2
        assert main(["serve", "--no-gateway", "--port", port, "--min-workers", "3",
                     "--max-workers", "2"]) == 2
    err = capsys.readouterr().err
    assert "--worker-url and --worker-dns go with --backend external" in err
    assert "--min-workers must be <= --max-workers" in err and "cannot listen" not in err


def test_serve_prices_reach_its_gateway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice serve --prices FILE`: its gateway costs requests by the table (without the
    flag every cost behind `sluice serve` was 0, so budgets never bit); a table that does
    not load exits 2 before anything starts."""
    from sluice.protocol.prompt import TokenCache
    from sluice.serve import gateway_wrap

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    prices = tmp_path / "prices.yaml"
    prices.write_text("m:\n  input_per_million: 2\n  output_per_million: 4\n")
    argv = ["serve", "--prices", str(prices)]
    wrap = gateway_wrap(build_parser(argv).parse_args(argv), TokenCache())
    state = wrap(None).state
    assert state.prices.cost("m", 1_000_000, 500_000) == 4.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("m:\n  input_per_million: .nan\n")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--prices", str(bad)])
    assert exit_.value.code == 2 and "cannot read the price table" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--pd-mode", "always"], ["--pd-min-uncached-tokens", "10"],
                                   ["--no-pd-rebalance"]])
def test_pd_flags_without_pd_are_refused(flags: list[str]) -> None:
    """`--pd-mode always` and the other --pd flags without `--pd P:D` started a plain
    worker and read none of them; now exit 2 naming the flag, before anything starts."""
    from sluice.serve import pd_ratio

    with pytest.raises(InvalidRequestError) as err:
        pd_ratio(parse("--workers", "2", *flags))
    assert err.value.param == flags[0][2:].replace("-", "_")
    assert str(err.value) == f"{flags[0]} needs --pd P:D (a disaggregated pool)"
    assert pd_ratio(parse("--workers", "2", "--pd", "1:1", *flags)) == (1, 1)


def test_a_bad_generation_config_exits_2_before_any_worker_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With a router, each local worker read the file and exited 2, and the controller
    started them again; now `sluice serve` reads it first, as it does without one."""
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    argv = ["serve", "--no-gateway", "--generation-config", str(tmp_path)]
    assert main([*argv, "--workers", "2"]) == 2
    assert "temperature must be a number" in capsys.readouterr().err


def test_sluice_serve_and_sluice_gateway_build_the_gateway_from_the_same_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One set of gateway flags (`gateway.flags`): the two commands read them into the
    same `GatewayConfig`, ledger and Redis settings included; a batch interval outside
    [0, 10] s is refused by the parser (exit 2) before anything starts."""
    from sluice.gateway.flags import gateway_config

    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    common = ["--database-url", f"sqlite:///{tmp_path}/g.db", "--redis-url",
              "redis://127.0.0.1:6379/9", "--on-redis-error", "open", "--await-ledger",
              "--ledger-batch-interval", "0.5", "--response-retention", "7",
              "--admin-key", "adm"]
    served = gateway_config(parse(*common))
    argv = ["gateway", "--upstream", "http://127.0.0.1:1", *common]
    gateway = gateway_config(build_parser(argv).parse_args(argv))
    assert served == gateway
    assert (served.await_ledger, served.ledger_batch_interval_s) == (True, 0.5)
    assert served.response_retention_s == 7 * 86400
    assert (served.limiter.redis_url, served.limiter.on_redis_error) == (
        "redis://127.0.0.1:6379/9", "open")
    defaults = gateway_config(parse())
    assert (defaults.await_ledger, defaults.ledger_batch_interval_s) == (False, 0.02)
    assert defaults.response_retention_s == 30 * 86400
    for flag, bad in (("--ledger-batch-interval", "11"), ("--ledger-batch-interval", "-1"),
                      ("--ledger-batch-interval", "soon"), ("--response-retention", "-1"),
                      ("--response-retention", "forever")):
        with pytest.raises(SystemExit) as exit_:
            parse(flag, bad)
        assert exit_.value.code == 2
