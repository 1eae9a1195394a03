"""`sluice sim` on bad input: exit 2 with one line on stderr, never a traceback or a hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.cli import main


@pytest.mark.parametrize("trace", ["missing.jsonl", "."])
def test_a_trace_that_cannot_be_read_is_an_error(
        trace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--trace", str(tmp_path / trace), "--workers", "2"]) == 2
    assert "sluice sim: error: cannot read trace file" in capsys.readouterr().err
