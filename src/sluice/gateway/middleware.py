"""`GatewayMiddleware`: who is calling and how much, in front of any OpenAI ASGI app.

Pure ASGI (Starlette style): it wraps the router's or a worker's app, or the httpx
proxy of `sluice gateway --upstream`. Per request under `/v1/` (and vLLM's `/classify`
and `/pooling`):

    1. authenticate   Bearer or x-api-key -> key + tenant (cached while the store's
                      auth version holds: revocation is immediate on every replica,
                      keycache.py)
    2. admit          model allowed (also for GET /v1/models/{id}; the GET /v1/models
                      list is filtered to the key's models, see models.py)? budget left?
                      priority within class? prompt tokens counted; the worst-case
                      cost reserved against the budget (budget.py); limiter charges 1
                      request, prompt + max_tokens tokens and a concurrency slot on
                      the key's and the tenant's scopes at once
    3. forward        the body with `priority` injected (and `stream_options
                      .include_usage` when streaming), client credentials removed,
                      x-sluice-tenant / x-sluice-priority / x-request-id added
    4. meter          usage read off the JSON body or the SSE stream as it passes;
                      x-ratelimit-* headers added to the response
    5. settle         exactly once per request (finished, failed, client-aborted,
                      refused, or cancelled during admission): tokens reconciled,
                      concurrency freed, ledger row + spend + the budget reservation's
                      release written in one transaction, *before* the last bytes go
                      to the client where admission reads it (a budget, a concurrency
                      limit; `await_ledger`), else just after (`GatewayState.later`);
                      kept in memory and retried while the database is down, with new
                      requests refused (503) once that buffer is full (ledger.py)

The Responses API's stored responses (`store`, `previous_response_id`, `GET` / `DELETE
/v1/responses/{id}`, its input items) and OpenAI's conversations (`/v1/conversations`,
a turn's `conversation`) are the gateway's: admission expands the earlier turns into
the input, settlement saves the final Response and extends the conversation
(responses.py, conversations.py).

`/admin/{tenants,keys,usage,purge}` and `/v1/usage` are served by the gateway's own
app (`admin.py`); other `/admin/...` routes (the router's) pass through;
`/metrics` is the upstream's text followed by the gateway's; everything else passes
through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.gateway.budget import check_budget
from sluice.gateway.config import GatewayConfig, priority_value
from sluice.gateway.limits import (
    Decision,
    LimiterUnavailableError,
    LocalLimiter,
    RedisLimiter,
    Scope,
    rate_limit_headers,
    too_large_for,
)
from sluice.gateway.meter import ResponseMeter
from sluice.gateway.models import MODEL_PREFIX, MODELS_PATH, ModelListFilter, allowed_models
from sluice.gateway.pricing import Price
from sluice.gateway.responses import ENDPOINTS as CONVERSATION_ENDPOINTS
from sluice.gateway.responses import EventLog, Run, Turn, failed_event
from sluice.gateway.state import GatewayState
from sluice.gateway.store import Principal, RunAdmission, UsageRecord, new_record_id
from sluice.gateway.tokens import estimate_view
from sluice.protocol.edge import (
    ANTHROPIC_PATHS,
    ON_DISCONNECT,
    BodyLimit,
    error_event,
    load_json_object,
    on_disconnect,
    read_body,
    refuse_kv_transfer_params,
    send_error,
)
from sluice.protocol.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.protocol.ids import unique_hex
from sluice.protocol.prompt import (
    EMBEDDINGS,
    IDS_HEADER,
    KIND_OF_PATH,
    READ_REQUEST,
    IdsHint,
    PromptView,
    ReadRequest,
    completion_texts,
    prompt_view,
)

logger = logging.getLogger(__name__)

Scope_ = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope_, Receive, Send], Awaitable[None]]

# Endpoints whose JSON body names a model and produces tokens.
GENERATION_ENDPOINTS = tuple(KIND_OF_PATH)
# Endpoints whose JSON body names a model but produces no tokens (Anthropic's token
# counting and OpenAI's for the Responses API, free of tokens and limited by requests
# only, as Anthropic rates it): the
# model is checked against the key's allow-list and recorded; nothing is reserved.
MODEL_ONLY_ENDPOINTS = ("/v1/messages/count_tokens", "/v1/responses/input_tokens")
EMBEDDINGS_PATH = "/v1/embeddings"
# the endpoints answered with embeddings (nothing generated), and the field of their texts
POOLED_INPUT = {EMBEDDINGS_PATH: "input", "/v1/score": "text_2", "/v1/rerank": "documents",
                "/v1/classify": "input", "/classify": "input", "/pooling": "input"}
RESPONSES_PATH = "/v1/responses"  # OpenAI's Responses API: usage as input/output_tokens
STREAM_USAGE_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# a worker's control routes (its P/D role; vLLM's runtime LoRA loading): an operator's,
# never a tenant's, so they take the admin key and pass through without metering
WORKER_CONTROL_PATHS = ("/v1/pd_role", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
# The gateway's own admin routes; other /admin/... paths (the router's /admin/workers)
# pass through to the inner app, which guards them with its own admin key.
GATEWAY_ADMIN_PREFIXES = ("/admin/tenants", "/admin/keys", "/admin/usage", "/admin/purge")
INLINE_COUNT_BYTES = 16 * 1024
MAX_COMPLETION_TOKENS = 2**31 - 1  # above any context length; keeps prices finite floats
INLINE_PARSE_BYTES = 64 * 1024
_DROP_HEADERS = {b"authorization", b"x-api-key", b"content-length", b"accept-encoding"}


def _header(scope: Scope_, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def api_key_of(scope: Scope_) -> str | None:
    """The client's key: `Authorization: Bearer <key>` or Anthropic's `x-api-key`."""
    auth = _header(scope, b"authorization")
    if auth and auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return _header(scope, b"x-api-key") or None


class _Stale(Exception):
    """A cached key answer found stale while admitting (auth_mirror.py): admit again."""


@dataclass
class Admission:
    """Everything decided before forwarding one request."""

    principal: Principal
    endpoint: str
    protocol: str
    request_id: str
    model: str | None = None
    body: bytes = b""
    priority: int = 1
    stream: bool = False
    strip_usage_chunk: bool = False
    prompt_tokens: int = 0
    reserved_tokens: int = 0
    tokens_param: str = "max_tokens"  # the field that sized the completion's reservation
    reservation: str | None = None  # the budget reservation, given back at settlement
    decision: Decision | None = None
    hint: IdsHint | None = None  # the prompt's ids, for the router and the worker
    turn: Turn | None = None  # a Responses request's stored state (responses.py)
    payload: dict[str, Any] | None = None  # the body's object (as `body` says, once sent)
    view: PromptView | None = None  # its prompt, as the one prompt view read it
    limiter_degraded: bool = False
    confirmed: bool = False  # the limiter's step confirmed a cached key answer (auth_mirror.py)
    headers: dict[str, str] = field(default_factory=dict)
    added: dict[str, Any] = field(default_factory=dict)  # top-level fields the gateway added
    rewritten: bool = False  # a field the client sent was changed: the body is re-encoded


def set_field(adm: Admission, payload: dict[str, Any], name: str, value: Any) -> None:
    """Set a top-level field of the forwarded body, noting whether it is new."""
    if name in payload:
        adm.rewritten = True
    else:
        adm.added[name] = value
    payload[name] = value


def append_fields(raw: bytes, fields: dict[str, Any], *, has_fields: bool) -> bytes:
    """`raw` (a JSON object, already parsed) with `fields` inserted before its closing
    brace: the client's bytes are kept, and no field is re-encoded."""
    end = raw.rstrip().rfind(b"}")
    extra = json.dumps(fields)[1:-1].encode()
    return raw[:end] + (b", " if has_fields else b"") + extra + b"}"


class GatewayMiddleware:
    """Pure ASGI middleware: `GatewayMiddleware(app, config_or_state)`.

    Given a `GatewayConfig` it builds its own `GatewayState` (store, limiter, prices,
    token counter, metrics); given a `GatewayState` it uses that one, which is how two
    replicas in one test share nothing but Redis and the database.
    """

    def __init__(self, app: ASGIApp, config: GatewayConfig | GatewayState | None = None) -> None:
        self.app = app
        if isinstance(config, GatewayState):
            self.state = config
        else:
            self.state = GatewayState.from_config(config or GatewayConfig())
        from sluice.gateway.admin import build_admin_app

        self.admin_app = build_admin_app(self.state)
        self._limited = BodyLimit(self._http, self.state.config.max_body_bytes)

    async def __call__(self, scope: Scope_, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        await self._limited(scope, receive, send)  # a body over the limit: 413

    async def _http(self, scope: Scope_, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path == "/v1/usage" or path.startswith(GATEWAY_ADMIN_PREFIXES):
            return await self.admin_app(scope, receive, send)
        if path == "/metrics":
            return await self._metrics(scope, receive, send)
        if path in WORKER_CONTROL_PATHS:
            try:
                self.state.config.check_admin(scope.get("headers") or [])
            except SluiceError as exc:
                return await send_error(send, exc, path)
            return await self.app(scope, receive, send)
        if path.startswith("/v1/") or path in GENERATION_ENDPOINTS:  # (/classify, /pooling)
            return await Exchange(self, scope, receive, send).run()
        return await self.app(scope, receive, send)

    async def _lifespan(self, scope: Scope_, receive: Receive, send: Send) -> None:
        """The inner app's lifespan; at startup also take up the records an earlier
        gateway left in the ledger's spool, on shutdown close the limiter and the store."""
        async def on_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.state.start()
            if message["type"] == "lifespan.shutdown.complete":
                await self.state.aclose()
            await send(message)

        await self.app(scope, receive, on_send)

    async def _metrics(self, scope: Scope_, receive: Receive, send: Send) -> None:
        captured: dict[str, Any] = {"status": 404, "body": bytearray()}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured["status"] = message["status"]
            elif message["type"] == "http.response.body":
                captured["body"] += message.get("body", b"")

        await self.app(scope, receive, capture)
        upstream = bytes(captured["body"]) if captured["status"] == 200 else b""
        body = upstream + self.state.metrics.render()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class Exchange:
    """One request through the gateway; owns its admission, meter and settlement."""

    def __init__(self, gateway: GatewayMiddleware, scope: Scope_, receive: Receive,
                 send: Send) -> None:
        self.gw, self.state = gateway, gateway.state
        self.scope, self.receive, self.send = scope, receive, send
        path: str = scope["path"]
        route = self.state.responses.route(path)
        self.stored = route is not None  # a stored response's or conversation's: answered here
        self.endpoint = route or path  # the ledger's name
        self.protocol = ("anthropic" if path in ANTHROPIC_PATHS else
                         "responses" if path == RESPONSES_PATH else "openai")
        self.started = time.perf_counter()
        self.adm: Admission | None = None
        self.meter = ResponseMeter(protocol=self.protocol)
        self.status = 0
        self.response_started = False
        self.disconnected = False
        self.settling: asyncio.Future[None] | None = None  # the settlement, once begun
        self.body_left: int | None = None  # a JSON response's bytes not yet sent, by its length
        self.queued: dict[str, Any] = {}  # a background response, as first answered
        self.begun: asyncio.Future[None] | None = None  # its `in_progress` being kept
        self.log: EventLog | None = None  # its stream, for whoever follows it

    # -- 1 + 2: authenticate and admit ---------------------------------------------------

    async def run(self) -> None:
        try:
            self.adm = await self.admit()
        except SluiceError as exc:
            return await self.refuse(exc)
        except BaseException:  # cancelled (or failed) mid-admission: free what it holds
            await asyncio.shield(self.settle("error"))
            raise
        self.state.metrics.overhead.observe(time.perf_counter() - self.started)
        self.state.metrics.inflight.inc()
        try:
            await self.forward()
        finally:
            self.state.metrics.inflight.dec()

    async def admit(self) -> Admission:
        if self.state.ledger.full:
            raise ServiceUnavailableError("the gateway cannot record usage: its database is "
                                          "unreachable; retry shortly", code="ledger_full")
        key = api_key_of(self.scope)
        if not key:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>' "
                                      "or 'x-api-key: <key>'")
        principal, unconfirmed = await self.authenticate(key)
        request_id = _header(self.scope, b"x-request-id") or unique_hex()
        raw: bytes | None = None
        while True:
            if principal is None:
                self.adm = None  # nobody to audit
                raise AuthenticationError("invalid or revoked API key")
            self.adm = Admission(principal, self.endpoint, self.protocol, request_id)
            if raw is None:
                raw = await read_body(self.receive, self.state.config.max_body_bytes)
                if raw is None:
                    raise InvalidRequestError("client disconnected while sending the body")
            try:
                return await self.admit_as(self.adm, raw, unconfirmed)
            except (SluiceError, _Stale) as exc:
                # a cached answer not yet confirmed (auth_mirror.py) refuses nothing: a
                # refusal stands only if the store's version says the answer is current
                if unconfirmed is None or self.adm.confirmed or (
                        not isinstance(exc, _Stale) and await self.current(unconfirmed)):
                    raise
            principal, unconfirmed = await asyncio.to_thread(self.state.keys.authenticate,
                                                             key), None

    async def admit_as(self, adm: Admission, raw: bytes, unconfirmed: int | None) -> Admission:
        payload = await self.parse_payload(raw) if self.scope["method"] == "POST" else None
        self.apply_policy(adm, payload)
        if payload is not None and self.endpoint in CONVERSATION_ENDPOINTS:
            adm.turn = await self.state.responses.prepare(
                payload, adm.principal.tenant.id, self.endpoint)
            adm.rewritten = adm.rewritten or adm.turn is not None
        adm.body, adm.payload = await self.outgoing_body(adm, raw, payload), payload
        await self.reserve(adm, None if self.endpoint in MODEL_ONLY_ENDPOINTS else payload,
                           unconfirmed)
        return adm

    async def current(self, version: int, decision: Decision | None = None) -> bool:
        """Whether an answer cached at `version` is still the store's: against the
        mirror `decision` read (no round trip), else the store's own version."""
        known = decision.auth_version if decision is not None else None
        if known is None:
            known = await self.state.keys.versions.current()
        return version >= known

    async def outgoing_body(self, adm: Admission, raw: bytes,
                            payload: dict[str, Any] | None) -> bytes:
        """The client's bytes as they came when policy changed nothing; with only new
        top-level fields (`priority`, `stream_options` the client did not send), those
        appended before the closing brace; re-encoded only when a field it sent changed."""
        if payload is None or (not adm.added and not adm.rewritten):
            return raw
        if not adm.rewritten:
            return append_fields(raw, adm.added, has_fields=len(payload) > len(adm.added))
        if len(raw) <= INLINE_PARSE_BYTES:
            return json.dumps(payload).encode()
        return (await asyncio.to_thread(json.dumps, payload)).encode()  # as large as the parse

    async def authenticate(self, key: str) -> tuple[Principal | None, int | None]:
        """(principal, the version it still has to be confirmed at, or None). From the
        key cache: with a mirror (Redis limiter), at once, confirmed later by the step
        that admits the request; else checked against the store's auth version, read
        inline when that is a local read (SQLite), else shared with the requests arriving
        meanwhile (`VersionReads`). A miss is looked up on a worker thread."""
        keys = self.state.keys
        if keys.mirror is not None:
            keys.mirror.check()
            if (found := keys.entry(key)) is not None:
                return found
        else:
            version = None if keys.inline else await keys.versions.current()
            if (principal := keys.cached(key, version)) is not None:
                return principal, None
        return await asyncio.to_thread(keys.authenticate, key), None

    async def parse_payload(self, raw: bytes) -> dict[str, Any] | None:
        """The JSON object of a generation request (400 for anything else); a large body
        is parsed on a worker thread, so one request's parse never stalls the others."""
        if self.endpoint not in GENERATION_ENDPOINTS and self.endpoint not in MODEL_ONLY_ENDPOINTS:
            return None
        if len(raw) <= INLINE_PARSE_BYTES:
            return load_json_object(raw, param="body")
        return await asyncio.to_thread(load_json_object, raw, param="body")

    def apply_policy(self, adm: Admission, payload: dict[str, Any] | None) -> None:
        """Model access, budget, priority class, streaming usage: all may raise."""
        tenant, key = adm.principal.tenant, adm.principal.key
        check_budget(tenant, self.state.metrics)
        adm.priority = effective_priority(adm.principal)
        if self.scope["method"] == "GET" and self.endpoint.startswith(MODEL_PREFIX):
            adm.model = self.endpoint[len(MODEL_PREFIX):]
            check_model_allowed(adm.model, tenant.settings.allowed_models,
                                key.settings.allowed_models)
        if payload is None:
            return
        refuse_kv_transfer_params(payload)
        adm.model = model_of(payload, allowed_models(adm.principal) is not None)
        check_model_allowed(adm.model, tenant.settings.allowed_models, key.settings.allowed_models)
        if self.endpoint in MODEL_ONLY_ENDPOINTS:
            return
        adm.stream = payload.get("stream") is True
        self.set_priority(adm, payload)
        if adm.stream and self.endpoint in STREAM_USAGE_ENDPOINTS:
            options = payload.get("stream_options") or {}
            if not isinstance(options, dict):
                raise InvalidRequestError("stream_options must be an object", param="stream_options")
            if not options.get("include_usage"):
                set_field(adm, payload, "stream_options", {**options, "include_usage": True})
                adm.strip_usage_chunk = True

    def set_priority(self, adm: Admission, payload: dict[str, Any]) -> None:
        asked = payload.get("priority")
        if asked is not None:
            if not isinstance(asked, int) or isinstance(asked, bool):
                raise InvalidRequestError("priority must be an integer", param="priority")
            if asked < adm.priority:
                raise InvalidRequestError(
                    f"priority {asked} is above this key's class (lowest value allowed: "
                    f"{adm.priority}; lower values run first)", param="priority")
            adm.priority = asked

    async def reserve(self, adm: Admission, payload: dict[str, Any] | None,
                      unconfirmed: int | None = None) -> None:
        if payload is not None:
            adm.prompt_tokens = await self.count_prompt(adm, payload)
            adm.reserved_tokens = adm.prompt_tokens + self.completion_reserve(adm, payload)
            await self.reserve_budget(adm)
        scopes = limit_scopes(adm.principal)
        try:
            decision = await self.state.limiter.acquire(scopes, adm.reserved_tokens)
        except LimiterUnavailableError as exc:
            self.on_limiter_error(exc, adm)
            if unconfirmed is not None and not await self.current(unconfirmed):
                raise _Stale() from None
            adm.confirmed = True
            return
        if unconfirmed is not None and not await self.current(unconfirmed, decision):
            if decision.lease is not None:  # admitted on a stale answer: give it back
                await self.state.limiter.give_back(decision.lease)
            raise _Stale()
        adm.confirmed = True
        adm.decision = decision
        adm.headers = decision.headers()
        if not decision.allowed:
            raise limit_error(decision, adm)

    async def reserve_budget(self, adm: Admission) -> None:
        """Reserve the request's worst-case cost against its tenant's budget, or refuse
        (429 insufficient_quota). Nothing to reserve without a budget or a price."""
        tenant = adm.principal.tenant
        worst = self.state.prices.cost(adm.model, adm.prompt_tokens,
                                       adm.reserved_tokens - adm.prompt_tokens)
        if tenant.settings.budget_usd is None:
            return
        if worst <= 0:
            self.warn_unpriced(adm.model, tenant.name)
            return
        reserving = asyncio.ensure_future(self.state.budgets.reserve(tenant, worst))
        try:
            adm.reservation = await asyncio.shield(reserving)
        except asyncio.CancelledError:  # learn what was reserved, so settle gives it back
            with contextlib.suppress(Exception):
                adm.reservation = await reserving
            raise

    def warn_unpriced(self, model: str | None, tenant: str) -> None:
        """A budget over a model priced 0 never bites (no `--prices`, or no entry for the
        model and no "*"): said once per model, in the log (it was silent)."""
        unpriced = self.state.unpriced_models
        if model in unpriced or self.state.prices.price(model) != Price():
            return
        unpriced.add(model)
        logger.warning("tenant %r has a budget, but the model %r has no price (no --prices "
                       "file, or no entry for it and no '*'): its requests cost $0 and do "
                       "not count against the budget", tenant, model)

    async def count_prompt(self, adm: Admission, payload: dict[str, Any]) -> int:
        """The prompt's tokens, read through the one prompt view (an image or another
        prompt the worker refuses is a 400 here); with a real tokenizer the ids also go
        downstream (`adm.hint`), so the router and the worker do not tokenize again."""
        counter = self.state.count_prompt_tokens
        tokens = getattr(counter, "prompt_tokens", None)
        kind = KIND_OF_PATH.get(self.endpoint)
        if kind == EMBEDDINGS:  # embeddings' and classify's `input`
            check_embeddings_input(payload)
        if tokens is None or kind is None:
            # a plain counter reads a completion's body: give it a scoring request's texts
            if kind is not None and self.endpoint in POOLED_INPUT:  # (or a chat form's turns)
                view = prompt_view(kind, payload)
                payload = {"model": adm.model, "prompt": list(view.texts)} \
                    if view.messages is None else {"model": adm.model,
                                                   "messages": payload["messages"]}
            return await self.count(adm.model, payload, len(adm.body))
        view = adm.view = prompt_view(kind, payload)
        ready = getattr(counter, "is_ready", None)
        if view.chars <= INLINE_COUNT_BYTES and (ready is None or ready(adm.model)):
            counted = tokens(adm.model, view)
        else:
            counted = await asyncio.to_thread(tokens, adm.model, view)
        if counted is None:
            return estimate_view(view)
        count, adm.hint = counted
        return int(count)

    async def count(self, model: str | None, body: dict[str, Any], size: int) -> int:
        """Token counting is CPU work: small bodies inline (a thread hop costs more than
        tokenizing a few KB), large ones on a worker thread so the loop keeps serving."""
        counter = self.state.count_prompt_tokens
        ready = getattr(counter, "is_ready", None)  # first use may load a tokenizer: thread
        if size <= INLINE_COUNT_BYTES and (ready is None or ready(model)):
            return counter(model, body)
        return await asyncio.to_thread(self.state.count_prompt_tokens, model, body)

    def completion_reserve(self, adm: Admission, payload: dict[str, Any]) -> int:
        """Tokens to reserve for the completion: max_tokens (or the default) times n, the
        field named in `adm.tokens_param`. More than MAX_COMPLETION_TOKENS is a 400 here:
        no model generates that much, and the worst case is priced in floats (`10**400`
        tokens overflowed into a 500)."""
        if self.endpoint in POOLED_INPUT:  # nothing is generated
            adm.tokens_param = POOLED_INPUT[self.endpoint]
            return 0
        name = "max_output_tokens" if self.endpoint == RESPONSES_PATH else \
            "max_completion_tokens" if "max_completion_tokens" in payload else "max_tokens"
        adm.tokens_param = name
        limit = payload.get(name)
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            limit = self.state.config.default_reserve_tokens
        n = payload.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        if limit * n > MAX_COMPLETION_TOKENS:  # named: the field that alone is too large, else n
            param = name if limit > MAX_COMPLETION_TOKENS else "n"
            raise InvalidRequestError(f"{name} (times n) asks for more than "
                                      f"{MAX_COMPLETION_TOKENS} tokens", param=param)
        return limit * n

    def on_limiter_error(self, exc: LimiterUnavailableError, adm: Admission) -> None:
        mode = self.state.config.limiter.on_redis_error
        m = self.state.metrics
        m.child(m.limiter_errors, mode).inc()
        logger.debug("rate limiter unavailable (%s); failing %s", exc, mode)
        if mode == "closed":
            raise exc
        adm.limiter_degraded = True

    async def refuse(self, exc: SluiceError) -> None:
        reason = type(exc).__name__
        m = self.state.metrics
        m.child(m.rejections, reason).inc()
        headers = {**(self.adm.headers if self.adm else {}), **exc.headers}
        self.status = exc.status_code
        if self.adm is not None:  # authenticated: audit the refusal
            await self.settle("rejected")
        exc.headers = headers
        await send_error(self.send, exc, self.endpoint)

    # -- 3 + 4: forward and meter ----------------------------------------------------------

    def upstream_scope(self, adm: Admission) -> Scope_:
        headers = [(k, v) for k, v in self.scope.get("headers") or []
                   if k.lower() not in _DROP_HEADERS and not k.lower().startswith(b"x-sluice-")
                   and k.lower() != b"x-request-id"]
        headers += [(b"content-length", str(len(adm.body)).encode()),
                    (b"x-request-id", adm.request_id.encode()),
                    (b"x-sluice-tenant", adm.principal.tenant.id.encode()),
                    (b"x-sluice-key-id", adm.principal.key.id.encode()),
                    (b"x-sluice-priority", str(adm.priority).encode())]
        if adm.hint is not None:
            headers.append((IDS_HEADER.encode(), adm.hint.encode()))
        scope = {**self.scope, "headers": headers}
        if adm.payload is not None:  # the router behind, in this process, reads no more
            read = ReadRequest(adm.body, adm.payload, KIND_OF_PATH.get(self.endpoint),
                               adm.view, adm.hint)
            scope["extensions"] = {**(self.scope.get("extensions") or {}), READ_REQUEST: read}
        watch = on_disconnect(self.scope)
        if watch is not None:  # the server's hang-up callback, seen here as `receive`'s
            def watch_here(callback: Callable[[], None]) -> Callable[[], None]:
                def gone() -> None:
                    self.disconnected = True
                    callback()
                return watch(gone)

            scope["extensions"] = {**scope["extensions"], ON_DISCONNECT: watch_here}
        return scope

    async def forward(self) -> None:
        assert self.adm is not None
        adm, body_sent = self.adm, False
        self.meter.strip_usage_chunk = adm.strip_usage_chunk
        if adm.turn is not None and adm.turn.patch:
            self.meter.patch = adm.turn.patch
        if self.stored:
            return await self.answer_stored(adm)
        if adm.turn is not None and adm.turn.background_id is not None:
            return await self.run_in_background(adm)

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": adm.body, "more_body": False}
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
            return message

        send: Send = self.on_send
        allowed = allowed_models(adm.principal)
        if allowed is not None and self.endpoint == MODELS_PATH and self.scope["method"] == "GET":
            send = ModelListFilter(self.on_send, allowed)  # only the models this key may use
        try:
            await self.gw.app(self.upstream_scope(adm), receive, send)
        except Exception as exc:
            await self.on_upstream_failure(exc)
        finally:  # settles here, or waits for the settlement on_send began
            settling = self.begin_settling("aborted" if self.disconnected or
                                           self.response_started else "error")
            if settling is not None and settling.done():  # mostly: on_send settled
                settling.result()
            elif settling is not None:
                await asyncio.shield(settling)

    async def run_in_background(self, adm: Admission) -> None:
        """`background`: answer the queued Response at once and run the request detached
        (responses.py). No client waits for the run, so a hang-up cancels nothing; its
        settlement (ledger row, limits, the final Response) is the run's, when it ends;
        POST .../cancel (or the gateway stopping) cancels it."""
        turn, responses = adm.turn, self.state.responses
        assert turn is not None and turn.background_id is not None and adm.payload is not None
        tenant = adm.principal.tenant.id
        turn.admission = RunAdmission(adm.request_id, adm.prompt_tokens, adm.reservation)
        try:
            self.queued = await responses.queue(turn, adm.payload, adm.model, tenant,
                                                adm.principal.key.id)
        except SluiceError as exc:
            return await self.refuse_admitted(adm, exc)
        log = self.log = EventLog()

        async def to_log(message: Message) -> None:  # the run's client: its stream's log
            if message["type"] == "http.response.body":
                log.add(message.get("body", b""))

        client, self.send = self.send, to_log
        task = asyncio.ensure_future(self.run_detached(adm))
        responses.add_run(turn.background_id, Run(tenant, task, log))
        gauge = self.state.metrics.background
        gauge.inc()

        def ended(_: asyncio.Future[None]) -> None:
            log.end()
            responses.end_run(turn.background_id or "")
            gauge.dec()

        task.add_done_callback(ended)
        if turn.streamed:  # its stream as it comes; leaving it stops nothing
            return await self.reply_stream(client, adm, log.follow())
        await self.reply(client, adm, self.queued)

    async def refuse_admitted(self, adm: Admission, exc: SluiceError) -> None:
        """The gateway's own refusal of an admitted request (its store's answer): settled
        as an error, then the error JSON with the rate-limit headers."""
        self.status = exc.status_code
        await self.settle("error")
        exc.headers = {**adm.headers, **exc.headers}
        await send_error(self.send, exc, self.endpoint)

    @staticmethod
    def own_headers(adm: Admission, *headers: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
        """`headers` and those of every answer of the gateway's own: the request's id and
        its rate-limit headers."""
        return [*headers, (b"x-request-id", adm.request_id.encode()),
                *((k.encode(), v.encode()) for k, v in adm.headers.items())]

    @classmethod
    async def reply_stream(cls, send: Send, adm: Admission,
                           events: AsyncIterator[bytes]) -> None:
        """A background run's events (its log, followed), as SSE; a client that has gone
        ends only this."""
        headers = cls.own_headers(adm, (b"content-type", b"text/event-stream"),
                                  (b"cache-control", b"no-cache"))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client left: the run goes on
            return

    @classmethod
    async def reply(cls, send: Send, adm: Admission, body: dict[str, Any]) -> None:
        """A 200 JSON answer of the gateway's own (its store's)."""
        raw = json.dumps(body).encode()
        headers = cls.own_headers(adm, (b"content-type", b"application/json"),
                                  (b"content-length", str(len(raw)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    async def run_detached(self, adm: Admission) -> None:
        """A background request through the inner app, its answer to no client: a run
        that ends without a final Response (the worker refused it, it failed, it was
        cancelled) leaves its stored Response `failed` or `cancelled`."""
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": adm.body, "more_body": False}
            await asyncio.Event().wait()  # no client to leave: only a cancel ends it
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 200:
                self.begun = asyncio.ensure_future(self.keep_queued(adm, "in_progress"))
                await asyncio.shield(self.begun)  # (a cancel meanwhile: end_unanswered waits)
            await self.on_send(message)

        scope = self.upstream_scope(adm)
        scope["extensions"] = {k: v for k, v in (scope.get("extensions") or {}).items()
                               if k != ON_DISCONNECT}
        ended = "failed"
        try:
            await self.gw.app(scope, receive, send)
            if self.meter.response is not None and 200 <= self.status < 300:
                ended = "done"
        except asyncio.CancelledError:
            ended, self.disconnected = "cancelled", True
            raise
        except Exception:
            logger.exception("background response %s failed", self.queued.get("id"))
        finally:
            settling = self.begin_settling("aborted" if self.disconnected else "error")
            if settling is not None:
                await asyncio.shield(settling)
            if ended != "done":
                await asyncio.shield(self.end_unanswered(adm, ended))

    async def end_unanswered(self, adm: Admission, status: str) -> None:
        """A background response that got no final Response: kept as `cancelled` (or,
        when the gateway stopped it, `failed`), or `failed` with the worker's error."""
        assert adm.turn is not None
        if status == "cancelled" and self.state.responses.stopping:
            status = "failed"
        error = None
        if status == "failed":
            error = {"code": "server_error", "message": "the gateway stopped before the "
                     "response ended" if self.state.responses.stopping else
                     f"the request failed with HTTP {self.status or 502}"}
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                found = json.loads(self.meter.body)["error"]
                error = {"code": found.get("code") or found.get("type") or "server_error",
                         "message": str(found.get("message"))}
        if self.begun is not None:  # its `in_progress` first, so that this one stands
            await asyncio.wait([self.begun])
        await self.keep_queued(adm, status, error)
        if status == "failed" and self.log is not None:  # its stream ends saying so
            number = self.log.events[-1][0] + 1 if self.log.events else 0
            self.log.add(failed_event(number, {**self.queued, "status": status,
                                               "error": error}))

    async def keep_queued(self, adm: Admission, status: str,
                          error: dict[str, str] | None = None) -> None:
        """Store the background response as first answered, with `status` (and `error`);
        a database error is logged (the run goes on; GET shows the last status kept)."""
        assert adm.turn is not None
        try:
            await self.state.responses.keep(adm.turn, {**self.queued, "status": status,
                                                       "error": error},
                                            adm.principal.tenant.id, adm.principal.key.id)
        except SluiceError:
            logger.exception("could not store background response %s as %s",
                             self.queued.get("id"), status)

    async def answer_stored(self, adm: Admission) -> None:
        """A stored response's route, answered from the store (responses.py)."""
        try:
            body = await self.state.responses.answer(
                self.scope["method"], self.scope["path"], self.scope.get("query_string") or b"",
                adm.body, adm.principal.tenant.id)
        except SluiceError as exc:
            return await self.refuse_admitted(adm, exc)
        self.status = 200
        await self.settle("ok")
        if isinstance(body, dict):
            return await self.reply(self.send, adm, body)
        await self.reply_stream(self.send, adm, body)  # a background one's stream

    async def on_send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            return await self.on_start(message)
        if message["type"] != "http.response.body":
            return await self.send(message)
        more = bool(message.get("more_body", False))
        body = message.get("body", b"")
        out = self.meter.feed(body)
        if self.body_left is not None:
            self.body_left -= len(body)
        if self.settling is None and (not more or self.meter.ended or
                                      self.body_left is not None and self.body_left <= 0):
            # the last bytes: by `more_body`, by a stream's last event, or by
            # content-length, since an app (the `--upstream` proxy) sends them with
            # more_body and then an empty message; the client has its answer then (and
            # may send its next request), so settle before, not after
            out += self.meter.finish()
            await self.settle(self.outcome())
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    def outcome(self) -> str:
        """How a response that ran to its end is recorded: `aborted` once the client has
        gone (the upstream's answer then reaches nobody: the sluice worker's 499 for a
        JSON request it cancelled on the hang-up), as for a stream cut short; else `ok`
        or `error` by the upstream's status."""
        if self.disconnected:
            return "aborted"
        return "ok" if 200 <= self.status < 400 else "error"

    async def on_start(self, message: Message) -> None:
        assert self.adm is not None
        self.status = int(message["status"])
        headers = list(message.get("headers") or [])
        ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
        self.meter.streaming = ctype.startswith(b"text/event-stream")
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        if not self.meter.streaming and length is not None and length.strip().isdigit():
            self.body_left = int(length)
        if self.meter.streaming and self.adm.strip_usage_chunk or self.meter.patch:
            headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        extra = {**self.adm.headers, "x-request-id": self.adm.request_id}
        names = {k.lower() for k, _ in headers}
        headers += [(k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in names]
        self.response_started = True
        await self.send({**message, "headers": headers})

    async def on_upstream_failure(self, exc: Exception) -> None:
        if self.disconnected or isinstance(exc, OSError) and self.response_started:
            return  # the client went away mid-response; settle() records the abort
        logger.exception("upstream app failed for request %s", self.adm and self.adm.request_id)
        if self.response_started:
            if self.meter.streaming:
                await self.end_stream(exc)
            return
        self.status = 502
        await self.settle("error")
        error = SluiceError(f"upstream failed: {type(exc).__name__}")
        error.status_code = 502
        await send_error(self.send, error, self.endpoint)

    async def end_stream(self, exc: Exception) -> None:
        """An upstream that failed mid-stream: settle as an `error` charged the tokens
        streamed so far (as a stream the client cut short is: they were generated and
        sent; it was recorded `aborted`, the client's hang-up), then end the client's
        stream with the error event its API
        streams (OpenAI's `data: {"error": ...}`, Anthropic's `event: error`), which the
        SDKs raise as their own errors; a cut event is not forwarded. The response was
        left unfinished: uvicorn cut the connection and the SDKs raised a bare transport
        error. After the stream's last event, it is only closed."""
        await self.settle("error")
        event = b""
        if not self.meter.ended:
            error = SluiceError(f"upstream failed mid-stream: {type(exc).__name__}: {exc}")
            error.status_code = 502
            event = error_event(error, self.endpoint)
        await self.send({"type": "http.response.body", "body": event, "more_body": False})

    # -- 5: settle ---------------------------------------------------------------------

    async def settle(self, status: str) -> None:
        """Exactly once: reconcile tokens, free the slot, write ledger + spend and release
        the budget reservation (one transaction), count; each before the response's last
        bytes where admission reads it (`release_now`, `ledger_now`), else just after.

        The first call starts the work as a task of its own and every call waits for
        it: a caller cancelled meanwhile does not cancel it. The `--upstream` proxy
        cancels its forwarding task, inside which on_send settles, when the client
        hangs up, and a client that closes on a stream's `data: [DONE]` did so while the
        settlement ran: its ledger row was never written. `forward` waits for it too."""
        settling = self.begin_settling(status)
        if settling is not None:
            await asyncio.shield(settling)

    def begin_settling(self, status: str) -> asyncio.Future[None] | None:
        """The settlement's task, started by the first call (None before admission)."""
        if self.adm is None:
            return None
        if self.settling is None:
            self.settling = asyncio.ensure_future(self._settle(self.adm, status))
        return self.settling

    async def _settle(self, adm: Admission, status: str) -> None:
        if adm.turn is not None and self.meter.response is not None \
                and 200 <= self.status < 300:  # before the client's last bytes: its next
            await self.save_response(adm, adm.turn, self.meter.response)  # turn
        prompt, completion = await self.final_tokens(status)
        release = self.release(adm, prompt + completion)
        if self.release_now(adm):
            await release
        else:
            self.state.later(release)
        record = self.record(status, prompt, completion)
        if self.ledger_now(adm):
            await self.write(record, adm.reservation)
        else:  # nothing at admission reads this row: written just after the response
            self.state.after(self.state.ledger.submit(record, adm.reservation),
                             lambda: self.counted(record))

    async def save_response(self, adm: Admission, turn: Turn,
                            response: dict[str, Any]) -> None:
        """Store the final Response; a database that fails here is logged (the client
        has been told `"store": true`: its next turn's `previous_response_id` is a 404)."""
        try:
            await self.state.responses.save(turn, response, adm.principal.tenant.id,
                                             adm.principal.key.id)
        except Exception:
            logger.exception("could not store response %s of request %s",
                             response.get("id"), adm.request_id)

    def release_now(self, adm: Admission) -> bool:
        """The limiter is reconciled before the last bytes when a concurrency or
        tokens-per-minute limit counts this request (the client's next request needs the
        slot back and the tokens reconciled); requests-per-minute needs no release."""
        tenant, key = adm.principal.tenant.settings, adm.principal.key.settings
        limits = (tenant.max_concurrent, key.max_concurrent, tenant.tpm, key.tpm)
        return self.state.config.await_ledger or any(x is not None for x in limits)

    def ledger_now(self, adm: Admission) -> bool:
        """The ledger row is committed before the last bytes when the tenant has a budget
        (its next admission reads the spend) or `await_ledger` is set."""
        return (self.state.config.await_ledger or adm.reservation is not None
                or adm.principal.tenant.settings.budget_usd is not None)

    def record(self, status: str, prompt: int, completion: int) -> UsageRecord:
        adm = self.adm
        assert adm is not None
        request_body, response_body = self.bodies(adm)
        model = self.meter.served_model or adm.model  # an adapter, a cascade's choice
        turn = adm.turn  # a background run's row has its response's id (`Turn.record_id`)
        record_id = turn.record_id if turn is not None and turn.record_id else new_record_id()
        return UsageRecord(
            request_id=adm.request_id, tenant_id=adm.principal.tenant.id,
            key_id=adm.principal.key.id, endpoint=self.endpoint, model=model,
            status=status, http_status=self.status or 499, prompt_tokens=prompt,
            completion_tokens=completion,
            cost_usd=self.state.prices.cost(model, prompt, completion),
            latency_ms=(time.perf_counter() - self.started) * 1000,
            request_body=request_body, response_body=response_body,
            record_id=record_id)

    async def final_tokens(self, status: str) -> tuple[int, int]:
        adm, m = self.adm, self.meter
        assert adm is not None
        failed_answer = status == "error" and not 200 <= self.status < 300  # upstream non-2xx
        if status == "rejected" or (failed_answer and m.prompt_tokens is None):
            return 0, 0
        prompt = m.prompt_tokens if m.prompt_tokens is not None else adm.prompt_tokens
        if m.completion_tokens is not None:
            return prompt, m.completion_tokens
        text = m.text
        if not text:
            return prompt, 0
        counted = await self.count(adm.model, {"prompt": text}, len(text))
        return prompt, counted

    async def release(self, adm: Admission, actual: int) -> None:
        if adm.decision is None or adm.decision.lease is None:
            return
        try:
            await self.state.limiter.finish(adm.decision.lease, actual)
        except LimiterUnavailableError as exc:
            m = self.state.metrics
            m.child(m.limiter_errors, "finish").inc()
            logger.error("could not reconcile request %s with the limiter: %s",
                         adm.request_id, exc)

    def bodies(self, adm: Admission) -> tuple[str | None, str | None]:
        """Request and response text for the audit log, redacted; None unless opted in."""
        if not adm.principal.tenant.settings.store_bodies:
            return None, None
        redact = self.state.redactor
        response = self.meter.text if self.meter.streaming else self.meter.body.decode(
            "utf-8", "replace")
        return redact(adm.body.decode("utf-8", "replace")), redact(response)

    async def write(self, record: UsageRecord, reservation: str | None) -> None:
        """Committed, or kept until the database is back (`LedgerWriter`); then counted."""
        await self.state.ledger.write(record, reservation)
        self.counted(record)

    def counted(self, record: UsageRecord) -> None:
        self.state.metrics.settled(record.tenant_id, record.status, record.prompt_tokens,
                                   record.completion_tokens, record.cost_usd)


# -- policy helpers (plain data in, decision out) -------------------------------------------


def effective_priority(principal: Principal) -> int:
    """The key's class may only lower (numerically raise) its tenant's class."""
    tenant_value = priority_value(principal.tenant.settings.priority_class)
    key_class = principal.key.settings.priority_class
    return max(tenant_value, priority_value(key_class)) if key_class else tenant_value


def model_of(payload: dict[str, Any], restricted: bool) -> str | None:
    """The body's `model`. Not a string is a 400 naming `model` (it was read as no model,
    and a key with an allow list got a 404 for "The model None"); absent, the upstream
    serves its default model, which a key limited to listed models must name."""
    model = payload.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"Invalid value for 'model': expected a string, got "
                                  f"{type(model).__name__}", param="model")
    if model is None and restricted:
        raise InvalidRequestError("you must provide a model parameter: this key may use "
                                  "only the models GET /v1/models lists", param="model")
    return model


def check_embeddings_input(payload: dict[str, Any]) -> None:
    """An embeddings body's `input` is counted as a completion prompt is; a bad one is a
    400 naming `input` (the counter's error named `prompt`, a field embeddings lack)."""
    try:
        completion_texts(payload.get("input", ""))
    except InvalidRequestError:
        raise InvalidRequestError("input must be a string, a list of strings, a list of "
                                  "token ids, or a list of token id lists",
                                  param="input") from None


def check_model_allowed(model: str | None, *allow_lists: tuple[str, ...] | None) -> None:
    for allowed in allow_lists:
        if allowed is not None and model not in allowed:
            raise NotFoundError(f"The model {model!r} does not exist or this key has no "
                                "access to it", param="model")


def limit_scopes(principal: Principal) -> list[Scope]:
    """The key's scope and its tenant's: a request must fit both."""
    k, t = principal.key.settings, principal.tenant.settings
    return [Scope(f"key:{principal.key.id}", k.rpm, k.tpm, k.max_concurrent),
            Scope(f"tenant:{principal.tenant.id}", t.rpm, t.tpm, t.max_concurrent)]


_REASONS = {
    "requests": "Rate limit reached for requests per minute",
    "tokens": "Rate limit reached for tokens per minute",
    "concurrency": "Too many concurrent requests",
}


def limit_error(decision: Decision, adm: Admission) -> RateLimitError:
    headers = rate_limit_headers(decision.scopes, decision.states)
    limit = too_large_for(decision.scopes, adm.reserved_tokens)
    if decision.reason == "too_large" and limit is not None:
        return too_large_error(limit, adm, headers)
    if (zero := zero_limit(decision.scopes)) is not None:
        return RateLimitError(
            f"{zero} is 0: no request is admitted until it is raised, so "
            "retrying does not help.", headers={**headers, "x-should-retry": "false"})
    message = _REASONS.get(decision.reason or "", "Rate limit reached")
    return RateLimitError(f"{message}. Please retry after the time in Retry-After.",
                          retry_after=decision.retry_after_s, headers=headers)


def zero_limit(scopes: Sequence[Scope]) -> str | None:
    """The limit that admits nothing (requests per minute or concurrent requests set to
    0, a paused key or tenant), named for the client, or None. Such a refusal had
    `Retry-After: 60` (or 1), so the SDKs waited and retried in vain."""
    for scope in scopes:
        owner = "This key's" if scope.name.startswith("key:") else "Its tenant's"
        if scope.rpm == 0:
            return f"{owner} requests per minute (RPM) limit"
        if scope.max_concurrent == 0:
            return f"{owner} concurrent requests limit"
    return None


def too_large_error(limit: int, adm: Admission, headers: dict[str, str]) -> RateLimitError:
    """OpenAI's answer to a request over the TPM limit on its own: 429, "Request too
    large ... Limit X, Requested Y", naming the field that sized it. No Retry-After (no
    wait makes it fit) and `x-should-retry: false`, which the OpenAI and Anthropic SDKs
    obey (they retried a 429 on their own backoff)."""
    field = adm.tokens_param
    what, cure = (("its input", f"shorten {field}") if field in POOLED_INPUT.values() else
                  (f"its prompt plus {field}", f"lower {field} or shorten the prompt"))
    return RateLimitError(
        f"Request too large for tokens per minute (TPM): Limit {limit}, Requested "
        f"{adm.reserved_tokens}. The request alone ({what}) exceeds the limit, so it can "
        f"never be admitted; {cure}.",
        param=field, headers={**headers, "x-should-retry": "false"})


__all__ = ["GatewayMiddleware", "GatewayState", "LocalLimiter", "RedisLimiter"]
