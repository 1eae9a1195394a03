"""The status board's numbers: percentiles as histogram_quantile, rates over a window,
per-tenant rows only for the admin, recent errors from the log."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from sluice.engine.stats import EngineStats
from sluice.observe.status import StatusBoard, parse_scrape, quantile
from sluice.worker.metrics import WorkerMetrics


def test_quantile_interpolates_inside_buckets_like_prometheus() -> None:
    buckets = {0.1: 10.0, 0.5: 90.0, 1.0: 100.0, float("inf"): 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (40 / 80))
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (9 / 10))
    assert quantile(0.05, buckets) == pytest.approx(0.05)
    assert quantile(0.99, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.99, {0.1: 1.0, float("inf"): 5.0}) == 0.1  # past the last finite bound


class FakeWorker:
    def __init__(self) -> None:
        self.stats = EngineStats(2, 1, 0.5, 100, prefix_cache_queries=100, prefix_cache_hits=0,
                                 num_preemptions=0, prompt_tokens=0, generation_tokens=0,
                                 num_steps=0)
        self.metrics = WorkerMetrics(lambda: self.stats, lambda: "m")

    def serve(self, ttft: float, n: int) -> None:
        for _ in range(n):
            self.metrics.ttft.labels("m").observe(ttft)
            self.metrics.success.labels("m", "stop").inc()

    def text(self) -> str:
        return generate_latest(self.metrics.registry).decode()


def test_scrape_reads_gauges_counters_and_histograms() -> None:
    w = FakeWorker()
    w.serve(0.02, 3)
    s = parse_scrape(w.text(), at=1.0)
    assert s.gauges == {"running": 2.0, "waiting": 1.0, "kv_usage": 0.5}
    assert s.counters["requests"] == 3 and s.counters["prefix_queries"] == 100
    assert s.histograms["vllm:time_to_first_token_seconds"][float("inf")] == 3


async def test_window_percentiles_rates_tenants_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorker()
    clock = [1000.0]
    monkeypatch.setattr("sluice.observe.status.time.time", lambda: clock[0])
    gateway = CollectorRegistry()
    Counter("sluice_gateway_requests", "x", ["tenant", "status"], registry=gateway).labels(
        "tn_a", "ok").inc(4)

    async def fetch(url: str) -> str:
        if "dead" in url:
            raise OSError("connection refused")
        return w.text()

    board = StatusBoard(lambda: [{"url": "http://w1", "healthy": True},
                                 {"url": "http://dead", "healthy": False}],
                        fetch, lambda: [generate_latest(gateway).decode()], window_s=30)
    board.open()
    try:
        w.serve(2.0, 10)  # slow requests long ago
        first = await board.snapshot()
        assert first["workers"][0]["ttft_p50"] > 1.0 and first["workers"][1]["reachable"] is False
        assert "tenants" not in first
        clock[0] += 10
        w.serve(0.004, 20)  # fast ones in the window
        w.stats = EngineStats(0, 0, 0.1, 100, 200, 80, 0, 0, 50, 0)
        logging.getLogger("sluice.router.proxy").warning("upstream w1 failed mid-stream")
        snap = await board.snapshot(admin=True)
    finally:
        board.close()
    row = snap["workers"][0]
    assert row["ttft_p99"] < 0.01  # only the window's requests
    assert row["requests_per_s"] == pytest.approx(2.0) and row["tokens_per_s"] == 5.0
    assert row["hit_rate"] == pytest.approx(0.8)  # 80 hits of 100 new queries
    assert snap["totals"]["healthy"] == 1 and snap["totals"]["workers"] == 2
    assert snap["tenants"] == [{"tenant": "tn_a", "requests": 4.0, "tokens": 0.0,
                                "spend_usd": 0.0}]
    assert [e["message"] for e in snap["errors"]] == ["upstream w1 failed mid-stream"]
    logging.getLogger("sluice").warning("after close")
    assert len(board.errors.records) == 1  # the handler is detached


async def test_status_routes_serve_the_page_and_json_in_front_of_any_app() -> None:
    import httpx

    from sluice.observe.asgi import StatusRoutes

    w = FakeWorker()
    w.serve(0.05, 2)

    async def fetch(_url: str) -> str:
        return w.text()

    async def inner(scope: object, receive: object, send: object) -> None:
        raise AssertionError("status paths must not reach the app")

    board = StatusBoard(lambda: [{"url": "http://me", "healthy": True}], fetch, lambda: [])
    app = StatusRoutes(inner, board, "k")  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
                                 base_url="http://t") as client:
        page = await client.get("/status")
        assert page.status_code == 200 and "status.json" in page.text
        anonymous = (await client.get("/status.json")).json()
        admin = (await client.get("/status.json", headers={"x-admin-key": "k"})).json()
    assert anonymous["workers"][0]["url"] == "http://me" and "tenants" not in anonymous
    assert anonymous["workers"][0]["ttft_p50"] is not None and admin["tenants"] == []


async def test_percentiles_of_an_idle_window_are_empty_not_the_old_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that served nothing in the last minute showed the TTFT percentiles of
    requests long gone (the board fell back to everything since start), beside a request
    rate of 0 and a hit rate of "–"; the page says its percentiles are the last minute's."""
    w = FakeWorker()
    clock = [1000.0]
    monkeypatch.setattr("sluice.observe.status.time.time", lambda: clock[0])

    async def fetch(_url: str) -> str:
        return w.text()

    board = StatusBoard(lambda: [{"url": "http://w1", "healthy": True}], fetch, lambda: [],
                        window_s=60)
    w.serve(0.3, 5)
    first = (await board.snapshot())["workers"][0]
    assert first["ttft_p50"] == pytest.approx(0.3, rel=0.5)  # one scrape: since start
    clock[0] += 5
    idle = (await board.snapshot())["workers"][0]
    assert idle["ttft_p50"] is None and idle["ttft_p99"] is None and idle["itl_p99"] is None
    assert idle["requests_per_s"] == 0.0
    w.serve(0.01, 5)
    clock[0] += 5
    busy = (await board.snapshot())["workers"][0]
    assert busy["ttft_p99"] is not None and busy["ttft_p99"] < 0.05  # only the window's
