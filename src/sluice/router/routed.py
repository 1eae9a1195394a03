"""The routed OpenAI endpoints' one code path, shared by the router's two HTTP front ends.

    (kind, path, body, headers) -> parse -> pool for the model
                                -> buffer (only while the pool has no ready worker)
                                -> request metadata
                                -> admission (waits only while no worker has room)
                                -> Proxy.forward (a disaggregated pool: PD.forward,
                                   prefill then decode worker: pd.py)
                                   (through the pool's Release when it has a canary or
                                   shadow worker: release.py)
                                -> Relay (stream it back, then close it), counted once in
                                   sluice_router_requests_total by its status, its first
                                   bytes timed once (first_byte_seconds); a stream
                                   that can migrate: a MigratingRelay (migrate.py),
                                   also on a release's version
    a SluiceError at any step   -> ErrorReply (OpenAI JSON, Anthropic's on /v1/messages;
                                   status, extra headers)

`sluice router` serves it from its own server (server.py); `build_app`'s ASGI app serves
it from a middleware (app.py) for uvicorn and the gateway. They differ only in how they
read the request and write the reply.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace

from sluice.observe.route_span import traced_route
from sluice.protocol.edge import error_headers, error_json
from sluice.protocol.errors import ServiceUnavailableError, SluiceError
from sluice.protocol.prompt import IDS_HEADER, KIND_OF_PATH, RESUME_HEADER, IdsHint, ReadRequest
from sluice.router.config import CANARY
from sluice.router.migrate import MigratingRelay, migratable, with_token_ids
from sluice.router.parse import SESSION_HEADER, parse_request
from sluice.router.proxy import NoWorkerReached, Proxy, Relay, WorkersFailed, forward_block
from sluice.router.release import version_asked
from sluice.router.state import RouterState

ROUTED = KIND_OF_PATH  # the paths routed to a worker, and their prompt kinds
_SESSION = SESSION_HEADER.encode()
_IDS = IDS_HEADER.encode()
_INTERNAL = frozenset({_IDS, RESUME_HEADER.encode()})  # set by the router, never by a client
# A 404 from a worker chosen as an adapter's holder: the adapter was unloaded there between
# the placement and the request's arrival (a restart, an admin unload); placed again,
# this often.
ADAPTER_MOVED_RETRIES = 3


@dataclass(frozen=True)
class ErrorReply:
    status: int
    headers: list[tuple[bytes, bytes]]  # content-type and length included
    body: bytes


def error_reply(exc: SluiceError, path: str = "") -> ErrorReply:
    """The error as its client expects it: Anthropic's JSON on /v1/messages, else OpenAI's."""
    body = error_json(exc, path)
    return ErrorReply(exc.status_code, error_headers(exc, body), body)


async def route(state: RouterState, kind: str, path: str, body: bytes,
                headers: list[tuple[bytes, bytes]], read: ReadRequest | None = None
                ) -> Relay | ErrorReply:
    """Route one POST to a worker; the caller streams the Relay back and closes it.

    `headers`: the client's, names lower-case (as ASGI and the server give them).
    `read`: what the gateway in front, in this process, read from `body` (protocol/prompt.py).
    Cancelling this (the client went away) closes the worker connection."""
    if state.tracing is not None:
        return await traced_route(state.tracing, functools.partial(_route, read=read), state,
                                  kind, path, body, headers)
    return await _route(state, kind, path, body, headers, read=read)


async def _route(state: RouterState, kind: str, path: str, body: bytes,
                 headers: list[tuple[bytes, bytes]], notes: dict[str, str] | None = None,
                 reached: list[bool] | None = None, read: ReadRequest | None = None
                 ) -> Relay | ErrorReply:
    """`route` itself; `notes` (when tracing) gets the request's model and policy.
    `reached`: an alias's attempt, not counted here; True is appended once a worker
    answered (or none could), and the alias's request is counted once, by its name."""
    try:
        session = next((v.decode("latin-1") for n, v in headers if n == _SESSION), None)
        req = parse_request(kind, body, {SESSION_HEADER: session} if session else {}, read)
        alias = state.aliases.get(req.model)
        if alias is not None:  # another model's name, or a cascade (cascade.py)
            start, tried = time.perf_counter(), list[bool]()
            reply = await alias.serve(req, lambda raw: _route(state, kind, path, raw, headers,
                                                              reached=tried))
            if tried and reached is not None:  # an alias of an alias: the outer counts
                reached.append(True)
            elif tried:  # once, whatever the alias tried
                state.metrics.requests_for(req.model, reply.status).inc()
                state.metrics.first_byte_seconds_for(req.model).observe(
                    time.perf_counter() - start)
            return reply
        pool = state.resolve(req.model)
        await state.buffer.admit(pool)  # held while the pool has no ready worker
        if notes is not None:
            notes.update(model=req.model, policy=pool.policy.name)
        given = read.hint if read is not None and read.body is body and read.hint else \
            next((IdsHint.decode(v) for n, v in headers if n == _IDS), None)
        meta, hint = await state.request_meta(pool, req, given)
        release = state.releases.get(pool) if pool.release_workers and pool.config.pd is None \
            else None
        if release is None and version_asked(headers) == CANARY:  # (a bad value: 400)
            raise ServiceUnavailableError(f"x-sluice-version: canary, but no canary serves "
                                          f"{req.model!r} (its pool has no canary worker, "
                                          "or is disaggregated)", code="no_canary_worker")
        chosen = release.choose_version(req, headers) if release is not None else None
        if chosen is not None:  # a canary request's adapter is placed among canary workers
            meta = replace(meta, version=chosen[0])
        unplaceable = state.pd.unplaceable(pool)  # a P/D pool's prefill workers
        holders_only = await state.adapters.prepare(pool, req.model, meta,  # adapters.py
                                                    unplaceable)
        try:  # until it is sent, its adapter is kept where it was placed
            block = forward_block(h for h in headers if h[0] not in _INTERNAL)
            if hint is not None:  # the worker takes these ids instead of tokenizing again
                block += _IDS + b": " + hint.encode() + b"\r\n"
            await state.admission.admit(pool, headers)  # nothing awaits from here to dispatch
            start = time.perf_counter()
            limit = state.config.migration_limit
            migrating = bool(limit) and migratable(req)
            sent = with_token_ids(req) if migrating else req
            target = path.encode("latin-1")
            proxy: Proxy = state.proxy
            if pool.config.pd is not None:  # prefill/decode disaggregation (pd.py)
                relay = await state.pd.forward(pool, sent, meta, target, block, holders_only)
                proxy = state.pd.local  # a stream resumes on a decode worker, prefilling there
            elif release is not None:  # a canary or shadow: the release picked the version
                held = frozenset(state.adapters.holders(req.model)) \
                    if state.adapters.is_adapter(req.model) else None
                relay = await release.forward(state.proxy, sent, meta, target, block, headers,
                                              chosen, held)
            else:
                def forward() -> Awaitable[Relay]:  # to the adapter's holders as last placed
                    return state.proxy.forward(pool, sent, meta, target, block, holders_only)

                try:
                    relay = await forward()
                except NoWorkerReached as exc:  # held until a worker is ready, then tried
                    # again (buffer.py); the first try outside, so the common path costs
                    # what it did
                    relay = await state.buffer.retry(pool, forward, NoWorkerReached, exc)
                for _ in range(ADAPTER_MOVED_RETRIES):  # its adapter was just moved: place again
                    if relay.status != 404 or not state.adapters.is_adapter(req.model):
                        break
                    relay.close()
                    state.adapters.lost(relay.ticket.endpoint.url, req.model)
                    state.adapters.unplace(req.model)
                    holders_only = await state.adapters.prepare(pool, req.model, meta,
                                                                unplaceable)
                    relay = await forward()
        except BaseException:
            state.adapters.unplace(req.model)
            raise
        state.adapters.served(relay, req.model)
        if reached is None:
            state.metrics.requests_for(req.model, relay.status).inc()  # once, whatever it took
            state.metrics.first_byte_seconds_for(req.model).observe(time.perf_counter() - start)
        else:
            reached.append(True)
        if not migrating or relay.status != 200:
            return relay
        return MigratingRelay(relay, proxy, pool, sent, meta, target, block, limit,
                              show_ids=bool(req.body.get("return_token_ids")),
                              held=state.buffer, exclude=holders_only)
    except WorkersFailed as exc:  # counted once, however often it was held and tried
        if reached is None:
            state.metrics.requests_for(exc.model, 503).inc()
        else:
            reached.append(True)
        return error_reply(exc, path)
    except SluiceError as exc:
        return error_reply(exc, path)
