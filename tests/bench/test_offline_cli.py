"""`sluice bench offline` on bad input: argparse's usage error for a bad count, one
error line and exit 2 for an engine that refuses its options; never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.cli import main


@pytest.mark.parametrize(("flag", "value"), [
    ("--num-requests", "0"), ("--batch", "0"), ("--input-len", "0"), ("--output-len", "-1"),
    ("--suffix-len", "0"), ("--prefix-len", "-1"), ("--max-num-batched-tokens", "0"),
    ("--num-requests", "many"),
])
def test_a_bad_count_is_a_usage_error(flag: str, value: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`--num-requests 0` ran and reported 0 tok/s; the others were engine tracebacks."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "offline", flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: must be an integer >=" in capsys.readouterr().err


def test_an_engine_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offline", "--peer", "none", "--no-flops",
                 "--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "sluice bench offline: error: model '/nonexistent/model.gguf' not found" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--single-stream", "--num-requests", "8"], "--single-stream does not use --num-requests"),
    (["--single-stream", "--batch", "4", "--prefix-len", "16"],
     "--single-stream does not use --batch, --prefix-len"),
    (["--single-stream", "--workload", "prefix"], "--single-stream runs one random prompt"),
    (["--suffix-len", "8"], "--workload random does not use --suffix-len"),
    (["--workload", "prefix", "--input-len", "64"], "--workload prefix does not use --input-len"),
    (["--workload", "prefix", "--peer", "transformers"], "--workload prefix does not use --peer"),
    (["--workload", "prefix", "--batch", "2", "4"], "--workload prefix runs at one --batch"),
])
def test_an_option_the_mode_does_not_read_is_an_error(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Each ran and was not read (`--single-stream --num-requests 8` ran one request and
    reported `num_requests: 64`; `--workload prefix --input-len 64` reported an input_len of
    64 for prompts of prefix + suffix tokens; `--batch 2 4` with prefix ran at 4 only),
    where `sluice bench serve` refuses a flag its workload does not use. Refused before
    the model loads."""
    assert main(["bench", "offline", "--model", "/nonexistent/model.gguf", *argv]) == 2
    err = capsys.readouterr().err
    assert f"sluice bench offline: error: {message}" in err and "not found" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("argv", "described"), [
    (["--single-stream", "--input-len", "8", "--peer", "none"],
     {"num_requests": 1, "input_len": 8}),
    (["--workload", "prefix", "--num-requests", "3", "--prefix-len", "16", "--suffix-len", "4",
      "--batch", "2"], {"num_requests": 3, "input_len": 20, "prefix_len": 16, "suffix_len": 4}),
])
def test_the_json_describes_what_ran(argv: list[str], described: dict[str, int], tiny_llama_dir: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A single stream reported the default `num_requests: 64`, a prefix run the default
    `input_len: 128`, neither of which it read."""
    assert main(["bench", "offline", "--model", str(tiny_llama_dir), "--output-len", "3",
                 "--no-flops", *argv]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {k: doc.get(k) for k in described} == described
    assert sum(r["requests"] for r in doc["results"][:1]) == described["num_requests"]
