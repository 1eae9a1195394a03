"""`sluice bench offline` on bad input: argparse's usage error for a bad count, one
error line and exit 2 for an engine that refuses its options; never a traceback."""

from __future__ import annotations

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
