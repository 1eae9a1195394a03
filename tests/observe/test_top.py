"""`sluice top` on bad input: a clear error and an exit status, never a traceback."""

from __future__ import annotations

import pytest

from sluice.cli import main


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_interval_is_a_usage_error(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["top", "--interval", interval])
    assert exit_.value.code == 2
    assert "--interval: must be a number of seconds > 0" in capsys.readouterr().err
