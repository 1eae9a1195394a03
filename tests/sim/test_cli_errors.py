"""`sluice sim` on bad input: exit 2 with one line on stderr, never a traceback or a hang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main


@pytest.mark.parametrize("trace", ["missing.jsonl", "."])
def test_a_trace_that_cannot_be_read_is_an_error(
        trace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(tmp_path / trace), "--workers", "2"]) == 2
    assert "sluice sim: error: cannot read trace file" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--random-range-ratio", "nan"], ["--workload", "trace", "--token-scale", "inf"],
    ["--workload", "trace", "--output-token-scale", "inf"],
    ["--workload", "trace", "--time-scale", "inf"], ["--burstiness", "inf", "--request-rate", "2"],
])
def test_nan_and_inf_workload_options_are_errors(
        argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n')
    if "trace" in argv:
        argv = [*argv, "--trace", str(trace)]
    assert main(["sim", "--num-prompts", "2", "--workers", "2", *argv]) == 2
    assert "must be >" in (err := capsys.readouterr().err) and "finite" in err


AUTOSCALE = ["--planner", "slo", "--min-workers", "1", "--max-workers", "2"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--scrape-interval", "0"], "scrape_interval_s must be > 0 and finite"),
    (["--scrape-interval", "nan"], "scrape_interval_s must be > 0 and finite"),
    (["--planner-interval", "nan", *AUTOSCALE], "planner_interval_s and latency_window_s must be > 0"),
    (["--cold-start", "nan", *AUTOSCALE], "cold_start_s >= 0, all finite"),
    (["--kv-event-lag-ms", "nan"], "kv_event_lag_s must be >= 0 and finite"),
    (["--prefix-index-blocks", "0"], "prefix_index_blocks must be >= 1"),
    (["--request-overhead-ms", "nan"], "request_overhead_s must be >= 0 and finite"),
    (["--host-contention", "nan"], "host_contention must be >= 0 and finite"),
    (["--speedup", "inf"], "--speedup must be > 0 and finite"),
    (["--rate-shape", "daily", "--duration", "inf"], "duration must be > 0 and finite"),
])
def test_bad_cluster_options_are_errors(argv: list[str], message: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `--scrape-interval 0` or nan, `--planner-interval nan` and a daily shape of
    infinite duration never ended; `--prefix-index-blocks 0` and `--request-overhead-ms nan`
    were tracebacks; nan cold starts, KV event lags and host contention ran and reported
    nan; `--speedup inf` made every step take no time."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n')
    assert main(["sim", "--trace", str(trace), "--workers", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert "sluice sim: error: " in err and message in err


@pytest.mark.parametrize("trace", [True, False])
@pytest.mark.parametrize("count", ["0", "-1"])
def test_num_prompts_below_one_is_an_error(count: str, trace: bool, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """It was taken as 'not given': 0 ran 100 synthetic requests or every trace row, and
    -1 ran every trace row but the last (`rows[:-1]`)."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n' * 3)
    argv = ["--trace", str(path)] if trace else []
    assert main(["sim", "--workers", "2", "--num-prompts", count, *argv]) == 2
    assert "sluice sim: error: --num-prompts must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flags"), [
    (["--trace", "TRACE", "--request-rate", "2"], "--request-rate"),
    (["--trace", "TRACE", "--burstiness", "0.5", "--input-len", "5"], "--input-len, --burstiness"),
    (["--time-scale", "5"], "--time-scale"),
    (["--token-scale", "0.1"], "--token-scale"),
    (["--workload", "random", "--trace", "TRACE"], "--trace"),
    (["--workload", "random", "--num-turns", "3"], "--num-turns"),
    (["--workload", "shared-prefix", "--random-range-ratio", "0.5"], "--random-range-ratio"),
])
def test_an_option_the_workload_does_not_read_is_an_error(
        argv: list[str], flags: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As `sluice bench serve` does; `sluice sim` ran without them and said nothing (a
    trace replayed at its own times under `--request-rate 2`, a random workload at
    `--time-scale 5`, a `--trace` with `--workload random` unread)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n')
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    assert main(["sim", "--num-prompts", "2", "--workers", "2", *argv]) == 2
    workload = argv[1] if argv[0] == "--workload" else ("trace" if "--trace" in argv else "random")
    assert f"sluice sim: error: --workload {workload} does not use {flags}" in capsys.readouterr().err


def test_the_options_a_workload_reads_still_work(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n')
    assert main(["sim", "--trace", str(trace), "--workers", "2", "--token-scale", "0.5",
                 "--output-token-scale", "2", "--time-scale", "2"]) == 0
    assert main(["sim", "--workload", "multi-turn", "--num-prompts", "2", "--workers", "2",
                 "--input-len", "8", "--output-len", "2", "--num-turns", "2",
                 "--random-range-ratio", "0.5", "--request-rate", "4", "--burstiness", "2"]) == 0
    assert main(["sim", "--workload", "shared-prefix", "--num-prompts", "2", "--workers", "2",
                 "--num-groups", "1", "--system-prompt-len", "16", "--input-len", "4"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where", ["missing/out", "."])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(
        flag: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was a FileNotFoundError / IsADirectoryError traceback after the simulation."""
    assert main(["sim", "--num-prompts", "2", "--workers", "2", flag, str(tmp_path / where)]) == 2
    captured = capsys.readouterr()
    assert f"sluice sim: error: {flag} " in captured.err and "no such directory" in captured.err
    assert "Simulation Result" not in captured.out  # nothing ran


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_policy_option_that_is_not_finite_is_an_error(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`prefix_weight=nan` made every worker's score nan: the router's pick found no
    lowest one and the run died in `random.choice([])` with an IndexError traceback."""
    assert main(["sim", "--workload", "shared-prefix", "--num-prompts", "4", "--workers", "2",
                 "--policy", "kv", "--policy-option", f"prefix_weight={value}"]) == 2
    assert "--policy-option" in (err := capsys.readouterr().err) and "(finite)" in err


def test_a_start_outside_the_planners_bounds_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`--workers 5 --max-workers 2` started 5 workers, above the bound the planner holds."""
    assert main(["sim", "--num-prompts", "2", "--workers", "5", "--planner", "slo",
                 "--min-workers", "1", "--max-workers", "2"]) == 2
    assert "--workers 5 is outside --min-workers 1 .. --max-workers 2" in capsys.readouterr().err
    assert main(["sim", "--num-prompts", "2", "--workers", "2", "--planner", "slo",
                 "--min-workers", "1", "--max-workers", "2"]) == 0
    capsys.readouterr()


def test_a_plot_format_matplotlib_cannot_write_is_refused_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--plot out.txt` ran the whole simulation, then was a ValueError traceback from
    matplotlib's savefig ("Format 'txt' is not supported")."""
    out = tmp_path / "out.txt"
    assert main(["sim", "--num-prompts", "2", "--workers", "2", "--plot", str(out)]) == 2
    captured = capsys.readouterr()
    assert f"sluice sim: error: --plot {out}: matplotlib does not write .txt" in captured.err
    assert "Simulation Result" not in captured.out and not out.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--trough-ratio", "0.5"], "--trough-ratio needs --rate-shape daily"),
    (["--planner-interval", "5"], "--planner fixed does not use --planner-interval: they need"),
    (["--cold-start", "5"], "--planner fixed does not use --cold-start: they need"),
    (["--scale-up-delay", "1", "--lookahead", "5"],
     "--planner fixed does not use --scale-up-delay, --lookahead: they need"),
    (["--target-kv-usage", "0.5", "--cold-start", "2"],
     "--planner fixed does not use --cold-start, --target-kv-usage: they need"),
])
def test_an_option_the_run_would_not_read_is_an_error(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each ran and said nothing: `--trough-ratio` without `--rate-shape daily` replayed the
    trace at its own times; a fixed pool never asks a planner, so its interval, a worker's
    cold start and the planner's delays and targets were not read."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n')
    assert main(["sim", "--trace", str(trace), "--workers", "2", *argv]) == 2
    captured = capsys.readouterr()
    assert f"sluice sim: error: {message}" in captured.err
    assert "Simulation Result" not in captured.out


def test_the_planner_options_still_reach_an_autoscaled_pool(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n' * 4)
    out = tmp_path / "sim.json"
    assert main(["sim", "--trace", str(trace), *AUTOSCALE, "--rate-shape", "daily",
                 "--duration", "20", "--trough-ratio", "0.5", "--cold-start", "3",
                 "--planner-interval", "2", "--scale-up-delay", "1", "--json", str(out)]) == 0
    capsys.readouterr()
    config = json.loads(out.read_text())["config"]
    assert config["cold_start_s"] == 3.0 and config["planner_config"]["scale_up_delay_s"] == 1.0


@pytest.mark.parametrize("rate", [[], ["--request-rate", "inf"]])
def test_burstiness_without_a_finite_rate_is_an_error(rate: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """It ran and was not read: with no rate every request arrives at 0, there are no gaps
    for the gamma shape to change (`sluice bench serve` ignored it the same way)."""
    assert main(["sim", "--num-prompts", "2", "--workers", "2", "--burstiness", "0.5", *rate]) == 2
    err = capsys.readouterr().err
    assert "sluice sim: error: --burstiness shapes the gaps between arrivals: it needs a finite " \
        "--request-rate" in err


def test_the_last_line_leaves_the_series_over_time_to_the_json_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The last stdout line held the replica count at every planner tick: it grows with
    the simulated time (86,400 entries for a day at the default interval), where the
    bench's line leaves its per-request records and series over time to `--json`."""
    out = tmp_path / "sim.json"
    assert main(["sim", "--num-prompts", "4", "--workers", "2", "--input-len", "8",
                 "--output-len", "2", "--request-rate", "1", "--json", str(out)]) == 0
    (line,) = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-1:]]
    (result,) = line["results"]
    assert "replicas_over_time" not in result and "requests" not in result
    assert result["completed"] == 4 and "worker_hours" in result
    assert json.loads(out.read_text())["results"][0]["replicas_over_time"]


@pytest.mark.parametrize("argv", [["sim", "--num-sessions", "4"], ["gateway", "--bogus", "4"],
                                  ["sim", "--num-sessions=4", "4"]])
def test_an_unknown_options_value_is_not_taken_for_a_subcommand(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Found by the docs new-user pass: `sluice sim --num-sessions 4` (the bench's flag)
    said "argument SIM: invalid choice: '4' (choose from 'calibrate')"."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "invalid choice" not in err
    assert f"sluice {argv[0]}: error: unrecognized arguments: {argv[1]} 4" in err


def test_a_command_that_needs_a_subcommand_still_lists_them(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "bogus"])
    assert "invalid choice: 'bogus' (choose from 'serve', 'offline')" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--planner", "bogus"], ["--num-prompts", "0"], ["--policy", "nope"], ["--slo", "ttft=x"],
    ["--workload", "trace"], ["--policy-option", "x"], ["--prefix-index-blocks", "0"],
    ["--planner", "slo", "--min-workers", "0", "--max-workers", "2"],
])
def test_a_bad_option_is_reported_before_the_no_profile_note(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """With no calibrated profile, 'no calibrated profile ...; using the built-in default'
    came first and the option's error after it: a note for a run that never started."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))  # no sim-profile.json there
    assert main(["sim", "--num-prompts", "2", "--workers", "2", *argv]) == 2
    assert (err := capsys.readouterr().err).startswith("sluice sim: error: ")
    assert "no calibrated profile" not in err


def test_the_no_profile_note_is_said_when_the_run_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    assert main(["sim", "--num-prompts", "2", "--workers", "2"]) == 0
    assert "sluice sim: no calibrated profile" in capsys.readouterr().err
