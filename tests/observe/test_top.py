"""`sluice top` on bad input: a clear error and an exit status, never a traceback."""

from __future__ import annotations

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


class _NotSluice(BaseHTTPRequestHandler):
    """Answers 200 to everything: HTML at /html/..., JSON of another shape at /json/..."""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        html = self.path.startswith("/html/")
        body = b"<html>hello</html>" if html else b'{"status": "ok"}'
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
