"""`python -m sluice.observe.targets`: the router's workers as a Prometheus file_sd file,
and the shipped `deploy/prometheus/prometheus.yml` that reads it (`promtool check
config`). A static list of worker ports went stale as soon as the controller replaced
a worker on a new port (found scraping `sluice serve --workers 2`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.observe.targets import run, target_groups, write_if_changed

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"


def _snapshot(*urls: str) -> dict[str, Any]:
    return {"workers": [{"url": u, "healthy": True} for u in urls]}


def test_target_groups_are_the_workers_host_and_port() -> None:
    snap = _snapshot("http://127.0.0.1:41233", "http://127.0.0.1:38411/", "http://127.0.0.1:41233")
    assert target_groups(snap) == [{"targets": ["127.0.0.1:38411", "127.0.0.1:41233"],
                                    "labels": {}}]
    assert target_groups(_snapshot()) == []


def test_a_worker_at_the_polled_port_is_left_out(tmp_path: Path) -> None:
    """`sluice serve` with one worker lists itself in /status.json; as a worker target
    too, Prometheus scraped its vllm:* series under both jobs and every sum doubled."""
    path = tmp_path / "sluice-workers.json"
    with _client([httpx.Response(200, json=_snapshot("http://127.0.0.1:8000"))]) as client:
        assert run(client, "http://127.0.0.1:8000", path, 1.0, once=True) == 0
    assert json.loads(path.read_text()) == []


def test_the_file_is_written_only_when_the_workers_change(tmp_path: Path) -> None:
    path = tmp_path / "sluice-workers.json"
    groups = target_groups(_snapshot("http://127.0.0.1:1"))
    assert write_if_changed(path, groups)
    assert json.loads(path.read_text()) == groups
    assert not write_if_changed(path, groups)
    assert write_if_changed(path, target_groups(_snapshot("http://127.0.0.1:2")))
    assert [p.name for p in tmp_path.iterdir()] == ["sluice-workers.json"]  # no temp left


def _client(replies: list[httpx.Response]) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/status.json"
        return replies.pop(0)

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_polls_follow_a_replaced_worker_and_a_failed_poll_keeps_the_file(
        tmp_path: Path) -> None:
    path = tmp_path / "sluice-workers.json"
    replies = [httpx.Response(200, json=_snapshot("http://127.0.0.1:1", "http://127.0.0.1:2")),
               httpx.Response(503, json={}),
               httpx.Response(200, json=_snapshot("http://127.0.0.1:1", "http://127.0.0.1:3"))]
    seen: list[list[str]] = []

    def sleep(_: float) -> None:
        seen.append(json.loads(path.read_text())[0]["targets"])
        if not replies:
            raise KeyboardInterrupt

    with _client(replies) as client, pytest.raises(KeyboardInterrupt):
        run(client, "http://router", path, 1.0, once=False, sleep=sleep)
    assert seen == [["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:2"],
                    ["127.0.0.1:1", "127.0.0.1:3"]]
    with _client([httpx.Response(503, json={})]) as client:
        assert run(client, "http://router", path, 1.0, once=True) == 1
    assert json.loads(path.read_text())[0]["targets"] == ["127.0.0.1:1", "127.0.0.1:3"]


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (apt-get install prometheus)")
def test_the_shipped_prometheus_config_reads_the_file(tmp_path: Path) -> None:
    for name in ("prometheus.yml", "sluice-rules.yml"):
        shutil.copy(PROM / name, tmp_path / name)
    write_if_changed(tmp_path / "sluice-workers.json",
                     target_groups(_snapshot("http://127.0.0.1:41233")))
    result = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "SUCCESS: 21 rules found" in out and "WARNING" not in out, out


def test_a_file_that_cannot_be_written_is_an_error_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "missing-dir" / "sluice-workers.json"
    with _client([httpx.Response(200, json=_snapshot("http://127.0.0.1:1"))]) as client:
        assert run(client, "http://router", path, 1.0, once=True) == 1
    assert "the file is left as it was" in capsys.readouterr().err
