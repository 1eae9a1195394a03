"""Prefill/decode disaggregation: the router's side of vLLM's `kv_transfer_params` flow.

A pool with `pd` set (PoolConfig.pd, `--prefill-worker` / `--decode-worker`) holds
prefill workers and decode workers (`both` workers serve as decode workers). Each
request of such a pool goes through `PD.forward` instead of the plain proxy:

    plan (chat and completions; messages always local)
      never / no prefill worker / no decode worker / n > 1 / several prompts -> local
      always                                          -> disaggregated
      conditional: on the decode worker the pool's policy would pick, uncached prompt
        tokens >= min_uncached_tokens (Dynamo's 2,048), and the best prefill worker's
        predicted wait (cost model: queue ahead of its prefill) <= max_prefill_wait_ratio
        x that decode worker's predicted prefill seconds   -> disaggregated, else local
    disaggregated
      1. prefill worker (pool policy: prefix hits and queue): the client's body with
         kv_transfer_params {do_remote_decode: true, do_remote_prefill: false, remote_*:
         null}, max_tokens 1 (max_completion_tokens 1 if given), stream false, no
         stream_options -> completion JSON with kv_transfer_params {do_remote_prefill:
         true, remote_engine_id, remote_block_ids, remote_host, remote_port,
         remote_request_id, tp_size}. No prefill worker, an error status or no
         kv_transfer_params in the answer -> local ("fallback")
      2. decode worker (least loaded: running + waiting, then KV usage): the client's
         body + those kv_transfer_params unchanged, relayed back as any response (a
         stream migrates mid-stream as any stream, to decode workers, prefilling there).
         503 `kv_transfer_failed` (the worker could not pull the KV, policy `fail`)
         -> the client's body on a decode worker ("fallback")
    local: the client's body on a decode worker chosen by the pool's policy; none could
      serve it (every decode worker ejected, dead, failing or switching) -> the client's
      body on a prefill worker ("fallback": a prefill worker is a whole engine)

Roles are the workers' own: `GET /v1/pd_role` -> {role, epoch, draining}, read every
`role_refresh_s` (a worker without the endpoint, e.g. vLLM, keeps its configured
role). Requests to a worker whose epoch is known carry `x-sluice-pd-epoch: N`; a 409
`stale_pd_epoch` (the role changed since) re-reads its role and sends the request
again if it still serves that side, else to another worker, before any byte reached
the client. `RoleTable.switch` changes a worker's role (the
planner's P:D ratio, control/pd.py): the router stops sending it requests, waits for
its own in-flight ones, then POSTs {role, expected_epoch, drain_timeout} with the epoch
it read (409: someone else switched it first).

Metrics: sluice_router_pd_requests_total{path}, and histograms of the prefill step,
the hand-off (prefill answer to the decode worker's first bytes, streams only) and
the decode (its first bytes to the end of the response).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from sluice.observe.buckets import LatencyBuckets
from sluice.protocol.errors import ConflictError, InvalidRequestError, ServiceUnavailableError
from sluice.protocol.openai import prompt_scoring
from sluice.router.breaker import Breakers
from sluice.router.config import BOTH, DECODE, PD_ROLES, PREFILL
from sluice.router.endpoints import Endpoint
from sluice.router.metrics import RouterMetrics
from sluice.router.parse import CHAT, COMPLETION, RESPONSES, ParsedRequest
from sluice.router.policies import Choice, RequestMeta
from sluice.router.policies.base import pick_min
from sluice.router.policies.cost import estimate_seconds, prefill_tokens, uncached_tokens
from sluice.router.pool import Decision, Pool
from sluice.router.proxy import Proxy, Relay, RetryableError, WorkersFailed
from sluice.router.upstream import UpstreamConnection, UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

EPOCH_HEADER = "x-sluice-pd-epoch"
STALE_EPOCH = "stale_pd_epoch"
KV_TRANSFER_FAILED = "kv_transfer_failed"
DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"
LOCAL_SIDE = "local"  # a decode worker that prefills itself
WARN_EVERY_S = 10.0
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
_ERROR_BODY_MAX = 64 * 1024


class RequestRefused(Exception):
    """The prefill worker refused the request itself (a 4xx other than 409): not a
    failure to fall back from; the client gets a decode worker's answer to it."""


class KVTransferFailed(Exception):
    """The decode worker answered 503 kv_transfer_failed: it could not pull the KV."""


# --- roles ------------------------------------------------------------------------------


@dataclass
class WorkerRole:
    """A worker's role as the router last read it. `epoch` None: the worker does not
    serve /v1/pd_role (a vLLM worker: its configured role stands, no fencing)."""

    role: str
    epoch: int | None = None
    draining: bool = False  # the worker says it is draining (a switch of its own)
    switching: bool = False  # this router is switching it: no new requests

    def serves(self, side: str) -> bool:
        if self.draining or self.switching:
            return False
        return self.role == PREFILL if side == PREFILL else self.role in (DECODE, BOTH)


class RoleTable:
    """Each worker's role, by URL. Touched on the event loop only."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.roles: dict[str, WorkerRole] = {}

    def get(self, endpoint: Endpoint) -> WorkerRole:
        found = self.roles.get(endpoint.url)
        if found is None:
            found = self.roles[endpoint.url] = WorkerRole(endpoint.spec.role or BOTH)
        return found

    def excluded(self, pool: Pool, side: str) -> set[str]:
        """URLs of `pool` that must not serve `side` (prefill, decode or local)."""
        role_side = PREFILL if side == PREFILL else DECODE
        return {url for url, e in pool.endpoints.items() if not self.get(e).serves(role_side)}

    def count(self, pool: Pool) -> dict[str, int]:
        """Available workers per role."""
        out = dict.fromkeys(PD_ROLES, 0)
        for e in pool.endpoints.values():
            if e.available:
                out[self.get(e).role] += 1
        return out

    def epoch_line(self, url: str) -> bytes:
        found = self.roles.get(url)
        if found is None or found.epoch is None:
            return b""
        return b"%s: %d\r\n" % (EPOCH_HEADER.encode(), found.epoch)

    async def refresh(self, endpoint: Endpoint) -> WorkerRole:
        """Read the worker's GET /v1/pd_role; keeps what it had when the worker has none."""
        entry = self.get(endpoint)
        try:
            resp = await self.client.get(endpoint.url + "/v1/pd_role", timeout=2.0)
            data = resp.json() if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return entry
        if isinstance(data, dict) and data.get("role") in PD_ROLES:
            epoch = data.get("epoch")
            entry.epoch = epoch if isinstance(epoch, int) else None
            entry.role = data["role"]
            if entry.role == BOTH and entry.epoch == 0 and endpoint.spec.role is not None:
                # started without --role and never switched: it serves either step, and
                # the router's configuration says which it gets (--prefill-worker)
                entry.role = endpoint.spec.role
            entry.draining = bool(data.get("draining", False))
        return entry

    async def refresh_all(self, pools: Iterable[Pool]) -> None:
        endpoints = [e for pool in pools if pool.config.pd is not None
                     for e in pool.endpoints.values()]
        await asyncio.gather(*(self.refresh(e) for e in endpoints))
        live = {e.url for e in endpoints}
        for url in [u for u in self.roles if u not in live]:
            del self.roles[url]

    async def switch(self, endpoint: Endpoint, role: str, drain_timeout_s: float = 30.0
                     ) -> WorkerRole:
        """Make `endpoint` a `role` worker without losing a request: stop routing to it,
        wait (up to `drain_timeout_s`) for the router's requests there to end, POST
        /v1/pd_role with the epoch the router last read (the one its decision was made
        on; read now if none), wait while the worker says it drains. Raises
        ConflictError when that epoch is stale (409: switched by someone else since),
        InvalidRequestError for another refusal."""
        if role not in PD_ROLES:
            raise InvalidRequestError(f"role must be one of {PD_ROLES}", param="role")
        entry = self.get(endpoint)
        if entry.epoch is None:
            entry = await self.refresh(endpoint)
        entry.switching = True
        try:
            deadline = time.monotonic() + drain_timeout_s
            while endpoint.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            body = {"role": role, "expected_epoch": entry.epoch,
                    "drain_timeout": max(0.0, deadline - time.monotonic())}
            resp = await self.client.post(endpoint.url + "/v1/pd_role", json=body,
                                          timeout=drain_timeout_s + 10.0)
            if resp.status_code == 409:
                await self.refresh(endpoint)
                raise ConflictError(f"{endpoint.url}: epoch {body['expected_epoch']} is "
                                    f"stale: {resp.text[:200]}", code=STALE_EPOCH)
            if resp.status_code != 200:
                raise InvalidRequestError(f"{endpoint.url} refused the role switch "
                                          f"({resp.status_code}): {resp.text[:200]}",
                                          param="role")
            while (await self.refresh(endpoint)).draining and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return entry
        finally:
            entry.switching = False


# --- one side's proxy --------------------------------------------------------------------


class SideProxy(Proxy):
    """The router's proxy, restricted to one side of a disaggregated pool.

    `side`: `prefill` (prefill workers, the pool's policy), `decode` (decode workers,
    least loaded: the KV comes with the request) or `local` (decode workers, the pool's
    policy: they prefill). Requests carry the worker's epoch; a 409 stale_pd_epoch is
    retried elsewhere; on `decode`, a 503 kv_transfer_failed raises KVTransferFailed.
    """

    def __init__(self, side: str, roles: RoleTable, upstream: UpstreamPool,
                 metrics: RouterMetrics, max_retries: int, eject_after_failures: int,
                 breakers: Breakers) -> None:
        super().__init__(upstream, metrics, max_retries, eject_after_failures, breakers)
        self.side = side
        self.roles = roles

    def choose(self, pool: Pool, meta: RequestMeta, tried: Iterable[str] = ()
               ) -> Decision | None:
        """This side's worker for `meta` (no side effects)."""
        skip = self.breakers.blocked(pool)
        skip.update(tried)
        skip.update(self.roles.excluded(pool, self.side))
        if self.side != DECODE:
            return pool.decide(meta, skip)
        endpoints = pool.candidates(meta.num_prompt_tokens, skip, meta.version)
        if not endpoints:
            return None
        stats = [e.stats() for e in endpoints]
        chosen, score = pick_min(stats, lambda s: s.running + s.waiting, pool.policy.rng,
                                 then=lambda s: s.kv_usage)
        # the prompt's KV arrives with the request: nothing of it is prefilled there
        whole = meta.num_prompt_tokens // max(1, meta.block_size)
        return Decision(pool.endpoints[chosen.url], Choice(chosen.url, whole, score), chosen)

    async def _open(self, endpoint: Endpoint, pool: Pool, req: ParsedRequest, path: bytes,
                    headers: bytes) -> tuple[UpstreamConnection, bytes]:
        """Proxy._open with the worker's epoch. A 409 stale_pd_epoch: its role is read
        again and, if it still serves this side, the request is sent again with the new
        epoch (else retried elsewhere); a 503 kv_transfer_failed on `decode` raises
        KVTransferFailed."""
        try:
            return await self._send(endpoint, pool, req, path, headers)
        except _Stale:
            role = await self.roles.refresh(endpoint)
            if not role.serves(PREFILL if self.side == PREFILL else DECODE):
                raise RetryableError(STALE_EPOCH, counts=False) from None
        try:
            return await self._send(endpoint, pool, req, path, headers)
        except _Stale:
            raise RetryableError(STALE_EPOCH, counts=False) from None

    async def _send(self, endpoint: Endpoint, pool: Pool, req: ParsedRequest, path: bytes,
                    headers: bytes) -> tuple[UpstreamConnection, bytes]:
        body = self._body(pool, req, endpoint)
        target = self._target(endpoint)
        payload = b"".join((b"POST ", target.prefix, path, b" HTTP/1.1\r\n", target.host_line,
                            headers, self.roles.epoch_line(endpoint.url),
                            b"Content-Length: %d\r\n\r\n" % len(body), body))
        try:
            upstream = await self.upstream.send(target, payload)
        except UpstreamError as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        try:
            if upstream.status in (409, 503):
                first = await _read_all(upstream)
                self._refused(upstream.status, _error_code(first))
            elif upstream.status >= 500:
                raise RetryableError(f"status {upstream.status}")
            else:
                first = await upstream.read()
        except (RetryableError, KVTransferFailed, _Stale):
            upstream.close()
            raise
        except UpstreamError as exc:
            upstream.close()
            raise RetryableError(f"{type(exc).__name__}: {exc}") from exc
        except BaseException:
            upstream.close()
            raise
        return upstream, first

    def _refused(self, status: int, code: str | None) -> None:
        """Raise for a 409 stale epoch or a 503; a 409 of any other kind passes on."""
        if status == 409 and code == STALE_EPOCH:
            raise _Stale()
        if status == 503 and code == KV_TRANSFER_FAILED and self.side == DECODE:
            raise KVTransferFailed("the decode worker could not pull the KV")
        if status == 503:
            raise RetryableError("status 503", counts=False)


class LocalSide(SideProxy):
    """The `local` side (decode workers prefilling themselves) with a last resort: when
    no decode worker could serve the request (each ejected, dead, failing or being
    switched), a prefill worker serves it whole, since it is a whole engine, rather than
    the client getting a 503. A stream that migrates resumes here too."""

    def __init__(self, prefill: SideProxy, *args: Any) -> None:
        super().__init__(LOCAL_SIDE, *args)
        self.prefill = prefill
        self.warned_at = -math.inf  # one warning per WARN_EVERY_S, not one per request

    async def forward(self, pool: Pool, req: ParsedRequest, meta: RequestMeta, path: bytes,
                      headers: bytes, exclude: Iterable[str] = ()) -> Relay:
        try:
            return await super().forward(pool, req, meta, path, headers, exclude)
        except WorkersFailed as exc:
            if pool.config.pd is None or self.prefill.choose(pool, meta, exclude) is None:
                raise
            now = time.monotonic()
            if now - self.warned_at >= WARN_EVERY_S:
                self.warned_at = now
                log.warning("no decode worker could serve a request of %r (%s); serving it "
                            "whole on a prefill worker (sluice_router_pd_requests_total"
                            "{path=\"fallback\"} counts each)", req.model, exc)
            return await self.prefill.forward(pool, req, meta, path, headers, exclude)


class _Stale(Exception):
    """The worker answered 409 stale_pd_epoch."""


async def _read_all(upstream: UpstreamConnection) -> bytes:
    parts: list[bytes] = []
    size = 0
    while (data := await upstream.read()) and size < _ERROR_BODY_MAX:
        parts.append(data)
        size += len(data)
    return b"".join(parts)


def _error_code(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


# --- the two-step flow -------------------------------------------------------------------


def can_hand_off(body: dict[str, Any]) -> bool:
    """Whether a prefill can hand `body` off: one prompt, one choice (a prefill worker
    answers n > 1 or a batch of prompts with a 400), and no prompt logprobs (vLLM's
    `prompt_logprobs`, or completions' `echo` with `logprobs`: the prefill worker would
    compute them and the decode worker, which answers, would not have them)."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    scores = prompt_scoring(body.get("prompt_logprobs"), body.get("echo"), body.get("logprobs"))
    return body.get("n") in (None, 1) and not several and scores is None


def prefill_body(body: dict[str, Any], kind: str = CHAT) -> dict[str, Any]:
    """The prefill worker's request: as vLLM's disaggregated proxy sends it (one token;
    a Responses request's is `max_output_tokens`)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    if kind == RESPONSES:
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    return out


def _request(req: ParsedRequest, body: dict[str, Any], learn: bool) -> ParsedRequest:
    """`req` with another body. `stream` here only tells the proxy whether to learn the
    worker's prefill speed from the time to the first bytes: yes for a prefill (its
    whole answer is one prefill and one token), no for a decode that pulls its KV."""
    return ParsedRequest(req.kind, body, req.model, learn, json.dumps(body).encode(),
                         req.view, req.session_key, req.max_tokens)


class PDMetrics:
    def __init__(self, registry: CollectorRegistry, buckets: LatencyBuckets) -> None:
        self.requests = Counter("sluice_router_pd_requests",
                                "requests of disaggregated pools, by how they were served "
                                "(disaggregated, local prefill, fallback to local)",
                                ["path"], registry=registry)
        self.prefill_seconds = Histogram("sluice_router_pd_prefill_seconds",
                                         "the prefill step: request to the prefill worker's "
                                         "whole answer", buckets=buckets.prefill,
                                         registry=registry)
        self.transfer_seconds = Histogram("sluice_router_pd_transfer_seconds",
                                          "the hand-off: the prefill answer to the decode "
                                          "worker's first bytes (streams)",
                                          buckets=buckets.first_byte, registry=registry)
        self.decode_seconds = Histogram("sluice_router_pd_decode_seconds",
                                        "the decode step: the decode worker's first bytes to "
                                        "the end of its response", buckets=buckets.decode,
                                        registry=registry)
        self.paths = {p: self.requests.labels(p) for p in (DISAGGREGATED, LOCAL, FALLBACK)}


class PD:
    """The router's disaggregation: roles, one proxy per side, the plan and the flow."""

    def __init__(self, client: httpx.AsyncClient, upstream: UpstreamPool,
                 metrics: RouterMetrics, max_retries: int, eject_after_failures: int,
                 breakers: Breakers, buckets: LatencyBuckets,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.roles = RoleTable(client)
        args = (self.roles, upstream, metrics, max_retries, eject_after_failures, breakers)
        self.prefill = SideProxy(PREFILL, *args)
        self.decode = SideProxy(DECODE, *args)
        self.local = LocalSide(self.prefill, *args)
        self.metrics = PDMetrics(metrics.registry, buckets)
        self.clock = clock

    def unplaceable(self, pool: Pool) -> set[str]:
        """Workers of `pool` a LoRA adapter is not placed on for a request (adapters.py):
        a disaggregated pool's prefill workers, which cannot serve a request whole (one
        holding the adapter anyway, pinned, may still prefill its requests)."""
        return self.roles.excluded(pool, DECODE) if pool.config.pd is not None else set()

    def plan(self, pool: Pool, req: ParsedRequest, meta: RequestMeta,
             exclude: Iterable[str] = ()) -> str:
        """DISAGGREGATED or LOCAL for this request (see the module docstring)."""
        config = pool.config.pd
        if config is None or config.mode == "never" \
                or req.kind not in (CHAT, COMPLETION, RESPONSES) or not can_hand_off(req.body):
            return LOCAL
        prefill = self.prefill.choose(pool, meta, exclude)
        if prefill is None:
            return LOCAL
        if config.mode == "always":  # no decode worker to hand off to: LOCAL's fallback
            return LOCAL if self.decode.choose(pool, meta, exclude) is None else DISAGGREGATED
        local = self.local.choose(pool, meta, exclude)
        if local is None:  # no decode worker at all: LOCAL falls back to a prefill worker
            return LOCAL
        if uncached_tokens(meta, local.choice.cached_blocks) < config.min_uncached_tokens:
            return LOCAL
        d, p = local.stats, prefill.stats
        local_prefill_s = d.seconds_per_token * prefill_tokens(meta, d)
        prefill_wait_s = estimate_seconds(meta, p) - p.seconds_per_token * prefill_tokens(meta, p)
        return DISAGGREGATED if prefill_wait_s <= config.max_prefill_wait_ratio * local_prefill_s \
            else LOCAL

    async def forward(self, pool: Pool, req: ParsedRequest, meta: RequestMeta, path: bytes,
                      headers: bytes, exclude: Iterable[str] = ()) -> Relay:
        """Serve `req` (the body to decode, `return_token_ids` included when it may
        migrate) on the pool's prefill and decode workers but those in `exclude` (those
        without the request's LoRA adapter: both steps run where it is); raises as
        Proxy.forward."""
        how = self.plan(pool, req, meta, exclude)
        if how == DISAGGREGATED:
            try:
                params = await self._prefill(pool, req, meta, path, headers, exclude)
            except RequestRefused:  # the request itself is bad: a decode worker says why
                params, how = None, LOCAL
            if params is not None:
                try:
                    return await self._decode(pool, req, meta, path, headers, params, exclude)
                except KVTransferFailed as exc:
                    log.warning("%s; prefilling on a decode worker", exc)
                except WorkersFailed as exc:
                    log.warning("no decode worker could take the hand-off (%s)", exc)
            if how == DISAGGREGATED:
                how = FALLBACK
        relay = await self.local.forward(pool, req, meta, path, headers, exclude)
        if self.roles.get(relay.ticket.endpoint).role == PREFILL:
            how = FALLBACK  # LocalSide's last resort
        self.metrics.paths[how].inc()
        return relay

    async def _prefill(self, pool: Pool, req: ParsedRequest, meta: RequestMeta, path: bytes,
                       headers: bytes, exclude: Iterable[str]) -> dict[str, Any] | None:
        """Step 1: the prefill worker's kv_transfer_params, or None (fall back)."""
        start = self.clock()
        try:
            relay = await self.prefill.forward(pool, _request(
                req, prefill_body(req.body, req.kind), True), meta, path, headers, exclude)
        except ServiceUnavailableError as exc:
            log.warning("no prefill worker answered (%s); prefilling on a decode worker", exc)
            return None
        try:
            body = relay.first
            while data := await relay.read():
                body += data
        except UpstreamError as exc:
            log.warning("prefill on %s failed: %s", relay.ticket.endpoint.url, exc)
            return None
        finally:
            relay.close()
        if 400 <= relay.status < 500 and relay.status != 409:
            raise RequestRefused(relay.status)
        if relay.status != 200:
            log.warning("prefill on %s answered %d: %s", relay.ticket.endpoint.url, relay.status,
                        body[:200].decode("utf-8", "replace"))
            return None
        try:
            params = json.loads(body).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            log.warning("prefill worker %s returned no kv_transfer_params",
                        relay.ticket.endpoint.url)
            return None
        self.metrics.prefill_seconds.observe(self.clock() - start)
        return params

    async def _decode(self, pool: Pool, req: ParsedRequest, meta: RequestMeta, path: bytes,
                      headers: bytes, params: dict[str, Any], exclude: Iterable[str]) -> Relay:
        """Step 2: the client's body with the prefill's kv_transfer_params, on a decode
        worker; its relay times the decode to its end."""
        handed = self.clock()
        body = {**req.body, "kv_transfer_params": params}
        relay = await self.decode.forward(pool, _request(req, body, False), meta, path, headers,
                                          exclude)
        first = self.clock()
        self.metrics.paths[DISAGGREGATED].inc()
        if req.stream:
            self.metrics.transfer_seconds.observe(first - handed)
        decode = self.metrics.decode_seconds
        then = relay.on_close

        def ended(r: Relay) -> None:
            if r.complete:
                decode.observe(self.clock() - first)
            if then is not None:
                then(r)

        relay.on_close = ended
        return relay

    async def run(self, pools: Callable[[], Iterable[Pool]], interval_s: float) -> None:
        """Read every disaggregated pool's roles every `interval_s` until cancelled."""
        while True:
            try:
                await self.roles.refresh_all(list(pools()))
            except httpx.HTTPError as exc:
                log.warning("reading workers' roles failed: %s", exc)
            await asyncio.sleep(interval_s)
