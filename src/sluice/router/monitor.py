"""Active health probes and load scraping, each on its own interval.

    every health_interval_s:  GET /health   -> success re-admits after N, failure ejects after M
                                                (a worker added at runtime: its first success
                                                admits it, Endpoint.hold_until_probed)
                              GET /v1/models   (once per worker, to learn the ids it serves)
    every scrape_interval_s:  GET /metrics  -> Endpoint.load (running, waiting, KV usage)

Passive failures (proxy) and active ones share one counter, so a worker that refuses
connections is ejected by whichever notices first, and only a probe brings it back.

A worker that is alive but answers nothing (SIGSTOP, a hung process, a partition that
drops packets) never closes its connections: its probes time out. Once such probes
have ejected it, each further timed-out probe calls `on_hung(endpoint)`, which cuts the
requests there that have received nothing for a while (state.py), so their streams
migrate and the requests before their first byte are retried elsewhere, instead of
waiting for the read timeout (600 s). A worker that refuses connections (shutting down,
draining its streams) is not hung: its streams go on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import httpx

from sluice.router.endpoints import Endpoint
from sluice.router.metrics import RouterMetrics
from sluice.router.pool import Pool
from sluice.router.scrape import parse_load

log = logging.getLogger(__name__)


class Monitor:
    def __init__(self, client: httpx.AsyncClient, pools: Callable[[], Iterable[Pool]],
                 metrics: RouterMetrics, *, timeout_s: float, eject_after: int,
                 readmit_after: int,
                 on_hung: Callable[[Endpoint], object] | None = None) -> None:
        self.client = client
        self.on_hung = on_hung
        self.pools = pools
        self.metrics = metrics
        self.timeout = httpx.Timeout(timeout_s)
        self.eject_after = eject_after
        self.readmit_after = readmit_after

    def endpoints(self) -> list[Endpoint]:
        return [e for pool in self.pools() for e in pool.endpoints.values()]

    async def probe(self, endpoint: Endpoint) -> bool:
        """One health probe; updates health (and discovers models). Returns success."""
        hung = False
        try:
            resp = await self.client.get(endpoint.url + "/health", timeout=self.timeout)
            ok = resp.status_code == 200
        except httpx.TimeoutException:
            ok, hung = False, True
        except httpx.HTTPError:
            ok = False
        if not ok:
            if endpoint.record_failure(self.eject_after):
                self.metrics.ejections.labels(endpoint.url).inc()
                log.warning("health probe ejected %s", endpoint.url)
            if hung and not endpoint.healthy and self.on_hung is not None:
                self.on_hung(endpoint)
            return False
        if not endpoint.models:  # before a worker's first request: the names it serves
            await self._discover(endpoint)
        if endpoint.record_success(self.readmit_after):
            self.metrics.readmissions.labels(endpoint.url).inc()
            log.info("re-admitted %s", endpoint.url)
        return True

    async def _discover(self, endpoint: Endpoint) -> None:
        try:
            resp = await self.client.get(endpoint.url + "/v1/models", timeout=self.timeout)
            data = resp.json().get("data", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        endpoint.models = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)

    async def scrape(self, endpoint: Endpoint) -> None:
        """Read the worker's load gauges; a worker without /metrics keeps zeros."""
        try:
            resp = await self.client.get(endpoint.url + "/metrics", timeout=self.timeout)
        except httpx.HTTPError:
            return
        if resp.status_code == 200:
            endpoint.load = parse_load(resp.text)
            endpoint.load_at = time.monotonic()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(e) for e in self.endpoints()))

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(e) for e in self.endpoints()))

    async def run(self, interval_s: float, once: Callable[[], Awaitable[None]]) -> None:
        """Call `once()` (a coroutine function) every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await once()
            except httpx.HTTPError as exc:  # a transport error not caught per endpoint
                log.warning("monitor round failed: %s", exc)
