"""`sluice top` on bad input: a clear error and an exit status, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sluice.cli import main


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_interval_is_a_usage_error(interval: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["top", "--interval", interval])
    assert exit_.value.code == 2
    assert "--interval: must be a number of seconds > 0" in capsys.readouterr().err


WORKER = "http://127.0.0.1:35487"
SNAPSHOT = {  # /status.json of `sluice serve --workers 1`, as it answered
    "time": 1796499054.6, "uptime_s": 28.0,
    "workers": [{"url": WORKER, "healthy": True, "reachable": True, "running": 0.0,
                 "waiting": 0.0, "kv_usage": 0.0, "window_s": 0.0, "hit_rate": 0.337,
                 "ttft_p50": 0.4, "ttft_p99": 0.99, "itl_p50": 0.083, "itl_p99": 0.97}],
    "totals": {"workers": 1, "healthy": 1, "running": 0.0, "waiting": 0.0,
               "requests_per_s": 0.0, "tokens_per_s": 0.0},
    "responses": {"200": 4.0}, "errors": []}


class _NotSluice(BaseHTTPRequestHandler):
    """Answers 200 to everything: HTML at /html/..., JSON of another shape at /json/...,
    a sluice snapshot at /sluice/..."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        html = self.path.startswith("/html/")
        body = b"<html>hello</html>" if html else b'{"status": "ok"}'
        if self.path.startswith("/sluice/"):
            body = json.dumps(SNAPSHOT).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html" if html else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def not_sluice() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _NotSluice)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", ["/html", "/json"])
def test_a_server_that_is_not_sluice_is_a_clear_error(
        not_sluice: str, path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--url", not_sluice + path, "--once"]) == 1
    err = capsys.readouterr().err
    assert "is not a sluice status snapshot" in err and "Traceback" not in err


def test_once_into_a_pipe_prints_whole_rows(not_sluice: str) -> None:
    """Piped, rich drew 80 columns: the worker column read `htt…` and health `hea…`."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "top", "--url",
                             not_sluice + "/sluice", "--once"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if WORKER in line)
    assert "healthy" in row and "33.7%" in row and "400.0 ms" in row and "970.0 ms" in row


def test_a_refused_admin_key_is_said(not_sluice: str) -> None:
    """A mistyped --admin-key showed the board without tenants and said nothing."""
    result = subprocess.run([sys.executable, "-m", "sluice.cli", "top", "--url",
                             not_sluice + "/sluice", "--once", "--admin-key", "wrong"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "tenants: the admin key was not accepted" in result.stdout


def test_the_per_token_columns_say_they_are_inter_token_latency() -> None:
    """They read "TPOT p50/p99" over the workers' `vllm:inter_token_latency_seconds`
    percentiles (every gap between tokens; a request's TPOT is the mean of its gaps, and a
    p99 of gaps is not a p99 of TPOTs): 690 ms "TPOT p99" on a worker whose requests' TPOT
    stayed under 200 ms. The status page had the same headers."""
    from pathlib import Path

    from sluice.observe.top import workers_table

    headers = [c.header for c in workers_table(SNAPSHOT).columns]
    assert "ITL p50" in headers and "ITL p99" in headers and not any("TPOT" in h for h in headers)
    page = (Path(__file__).parents[2] / "src/sluice/observe/status.html").read_text()
    assert "<th>ITL p50</th><th>ITL p99</th>" in page and "TPOT" not in page
