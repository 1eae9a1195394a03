"""Forward one request to a worker and stream its response back, without buffering.

    for each attempt (1 + max_retries, each on a worker not yet tried):
        decide -> dispatch -> send, read headers and the first body chunk
        connect error / read error / 5xx before the first chunk -> count, retry elsewhere
    relay: first chunk, then the rest as it arrives; when the stream ends (or the client
    goes away, which cancels the relay), close the upstream response (so the worker sees
    the disconnect and aborts) and stop counting the request in flight.

Nothing reaches the client before the first chunk has arrived, so every retry is invisible
to it. Passive health lives here: each failure counts toward the worker's ejection.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import anyio
import httpx
from starlette.responses import Response, StreamingResponse

from sluice.protocol.errors import ServiceUnavailableError
from sluice.router.endpoints import Endpoint, Ticket
from sluice.router.metrics import RouterMetrics
from sluice.router.parse import ParsedRequest
from sluice.router.policies import RequestMeta
from sluice.router.pool import Decision, Pool

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})
RESPONSE_DROP = HOP_BY_HOP - {"content-length"} | {"server", "date"}


class RetryableError(Exception):
    """The attempt failed before any byte reached the client.

    `counts`: whether it counts toward ejecting the worker (a 503 is a busy worker
    shedding load, not a broken one: retried elsewhere, never ejected for it).
    """

    def __init__(self, message: str, counts: bool = True) -> None:
        super().__init__(message)
        self.counts = counts


@dataclass
class Upstream:
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


class Proxy:
    """Sends requests for a router; holds its shared client and retry/ejection settings."""

    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics, max_retries: int,
                 eject_after_failures: int) -> None:
        self.client = client
        self.metrics = metrics
        self.max_retries = max_retries
        self.eject_after = eject_after_failures
        self._urls: dict[str, httpx.URL] = {}  # parsed once: URL parsing is ~60 µs

    def _url(self, endpoint: Endpoint, path: str) -> httpx.URL:
        key = endpoint.url + path
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = httpx.URL(key)
        return url

    async def forward(self, pool: Pool, req: ParsedRequest, meta: RequestMeta, path: str,
                      headers: Mapping[str, str]) -> Response:
        tried: list[str] = []
        last_error = "no worker is available"
        for _attempt in range(self.max_retries + 1):
            decision = self._decide(pool, meta, tried)
            if decision is None:
                break
            endpoint = decision.endpoint
            ticket = pool.dispatch(meta, decision)
            self.metrics.prefix_hit_tokens.labels(pool.policy.name).inc(
                min(meta.num_prompt_tokens, decision.choice.cached_blocks * meta.block_size))
            try:
                upstream = await self._open(endpoint, pool, req, path, headers)
            except RetryableError as exc:
                endpoint.finish(ticket)
                self._failed(endpoint, exc)
                tried.append(endpoint.url)
                last_error = f"{endpoint.url}: {exc}"
                continue
            except BaseException:  # cancelled: the client went away before the first byte
                endpoint.finish(ticket)
                raise
            endpoint.consecutive_failures = 0
            endpoint.on_first_byte(ticket, learn=req.stream)
            self.metrics.requests.labels(req.model, str(upstream.response.status_code)).inc()
            return self._relay(upstream, ticket)
        self.metrics.requests.labels(req.model, "503").inc()
        raise ServiceUnavailableError(f"no healthy worker could serve model {req.model!r} "
                                      f"({last_error})", code="no_healthy_worker")

    def _decide(self, pool: Pool, meta: RequestMeta, tried: list[str]) -> Decision | None:
        start = time.perf_counter()
        decision = pool.decide(meta, tried)
        self.metrics.decision_seconds.labels(pool.policy.name).observe(time.perf_counter() - start)
        if decision is not None:
            self.metrics.decisions.labels(pool.policy.name, decision.endpoint.url).inc()
            self.metrics.prompt_tokens.labels(pool.policy.name).inc(meta.num_prompt_tokens)
        return decision

    def _failed(self, endpoint: Endpoint, exc: RetryableError) -> None:
        self.metrics.retries.labels(endpoint.url, str(exc).split(":")[0]).inc()
        if exc.counts and endpoint.record_failure(self.eject_after):
            self.metrics.ejections.labels(endpoint.url).inc()
            log.warning("ejected %s after %d failures", endpoint.url, endpoint.consecutive_failures)

    def _body(self, pool: Pool, req: ParsedRequest, endpoint: Endpoint) -> bytes:
        model = pool.upstream_model(req.model, endpoint)
        if model == req.model:
            return req.raw
        return json.dumps({**req.body, "model": model}).encode()

    async def _open(self, endpoint: Endpoint, pool: Pool, req: ParsedRequest, path: str,
                    headers: Mapping[str, str]) -> Upstream:
        """Send and wait for the first body chunk; raise RetryableError on failure before it."""
        body = self._body(pool, req, endpoint)
        request = self.client.build_request("POST", self._url(endpoint, path), content=body,
                                            headers=forward_headers(headers))
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        try:
            if response.status_code >= 500:
                raise RetryableError(f"status {response.status_code}",
                                     counts=response.status_code != 503)
            chunks = response.aiter_raw()
            first = await anext(chunks, b"")
        except RetryableError:
            await response.aclose()
            raise
        except httpx.TransportError as exc:
            await response.aclose()
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:  # cancelled: hang up so the worker aborts
            with anyio.CancelScope(shield=True):
                await response.aclose()
            raise
        return Upstream(response, chunks, first)

    def _relay(self, upstream: Upstream, ticket: Ticket) -> StreamingResponse:
        headers = {k: v for k, v in upstream.response.headers.items()
                   if k.lower() not in RESPONSE_DROP}
        return StreamingResponse(_stream(upstream, ticket), status_code=upstream.response.status_code,
                                 headers=headers)


async def _stream(upstream: Upstream, ticket: Ticket) -> AsyncIterator[bytes]:
    """Yield the response as it arrives; always close upstream and end the accounting."""
    try:
        if upstream.first:
            yield upstream.first
        async for chunk in upstream.chunks:
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("upstream %s failed mid-stream: %s", ticket.endpoint.url, exc)
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.response.aclose()
        ticket.endpoint.finish(ticket)
