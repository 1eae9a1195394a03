"""The worker's HTTP app: OpenAI and Anthropic endpoints around one AsyncEngine.

    build_app(engine, config) -> FastAPI
      POST /v1/chat/completions  /v1/completions  /v1/messages   (JSON or SSE)
      POST /v1/responses  (OpenAI's Responses API, stateless: protocol/responses.py)
      GET  /v1/models  /health  /metrics  /version        POST /tokenize  /detokenize
      POST /v1/messages/count_tokens (Anthropic's, as vLLM serves it)
      POST /v1/responses/input_tokens (OpenAI's count of a Responses request's input)
      GET/POST /v1/pd_role (P/D role, epoch fencing: sluice.worker.pd)

The engine core runs in its own process (AsyncEngine.spawn); handlers only await
its output queues, so a long prefill never blocks this event loop. Bodies are parsed by hand
(`parse_body`) so every failure is one of sluice's errors, rendered by one handler:
OpenAI's error JSON everywhere, Anthropic's on `/v1/messages` (and count_tokens). A stream that ends
early (client disconnect) closes its `Run`, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice import __version__
from sluice.observe.asgi import TraceContext
from sluice.protocol import anthropic, responses
from sluice.protocol.edge import (
    ANTHROPIC_PATHS,
    BodyLimit,
    http_status_error,
    load_json_object,
)
from sluice.protocol.errors import (
    ClientDisconnected,
    InvalidRequestError,
    NotFoundError,
    SluiceError,
)
from sluice.protocol.openai import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    check_continue,
    parse_request,
    reject_unsupported,
)
from sluice.protocol.prompt import (
    IDS_HEADER,
    KIND_OF_PATH,
    RESUME_HEADER,
    TOKENIZER_HEADER,
    IdsHint,
    ResumeIds,
    fingerprint,
)
from sluice.worker import embeddings as pooling
from sluice.worker.chat import chat_chunks, chat_response, prepare_chat
from sluice.worker.completions import completion_chunks, completion_response, prepare_completion
from sluice.worker.config import WorkerConfig
from sluice.worker.lora import add_lora_routes
from sluice.worker.pd import add_pd_routes, check_epoch
from sluice.worker.sampling import chat_prompt, check_token_ids
from sluice.worker.state import WorkerState

if TYPE_CHECKING:
    from sluice.engine.async_engine import AsyncEngine

log = logging.getLogger("sluice.worker")


def build_app(engine: AsyncEngine | None, config: WorkerConfig) -> FastAPI:
    """The ASGI app; `engine` may be None and attached later via `app.state.worker.attach`."""
    state = WorkerState(engine, config)
    app = FastAPI(title="sluice worker")
    app.state.worker = state
    app.add_middleware(RequestIdMiddleware)
    if state.tracing is not None:  # the incoming traceparent parents the request's span
        app.add_middleware(TraceContext, tracing=state.tracing)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.add_exception_handler(SluiceError, _sluice_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    _add_routes(app, state)
    return app


# --------------------------------------------------------------------------- routes


def _add_routes(app: FastAPI, state: WorkerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        check_epoch(request, state)
        body = with_header_priority(request, state, await parse_body(request))
        req = parse_request(ChatCompletionRequest, reject_unsupported(body, UNSUPPORTED_CHAT))
        req.check_tool_turns()
        job = await until_disconnect(request, prepare_chat(
            state, req, request_id(request), ids_hint(request), resumed_ids(request, state)))
        if req.stream:
            return SSEResponse(openai_sse(chat_chunks(job)), _ids_headers(state, req))
        return await until_disconnect(request, _json(chat_response(job)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_epoch(request, state)
        body = with_header_priority(request, state, await parse_body(request))
        req = parse_request(CompletionRequest, reject_unsupported(body, UNSUPPORTED_COMPLETION))
        job = await until_disconnect(request, prepare_completion(
            state, req, request_id(request), ids_hint(request), resumed_ids(request, state)))
        if req.stream:
            return SSEResponse(openai_sse(completion_chunks(job)), _ids_headers(state, req))
        return await until_disconnect(request, _json(completion_response(job)))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        check_epoch(request, state)
        body = await parse_body(request)
        req = parse_request(anthropic.MessagesRequest, anthropic.reject_unsupported(body))
        chat_body = anthropic.to_chat_body(req)
        if req.thinking is not None and req.thinks and state.engine_thinks:
            chat_body["thinking_token_budget"] = req.thinking.budget_tokens  # kept by the engine
        if (priority := header_priority(request, state)) is not None:
            chat_body["priority"] = priority
        try:
            chat_req = parse_request(ChatCompletionRequest, chat_body)
            job = await until_disconnect(request, prepare_chat(
                state, chat_req, request_id(request), ids_hint(request),
                resumed_ids(request, state)))
        except InvalidRequestError as exc:  # name the field as the Anthropic client wrote it
            exc.param = anthropic.anthropic_param(exc.param)
            raise
        if req.stream:
            translator = anthropic.StreamTranslator(req)
            if job.replayed is not None:  # a resumed stream: its events were sent before
                translator.replay(job.replayed.model_dump())
            return SSEResponse(translated_sse(chat_chunks(job), translator, anthropic.sse),
                               _ids_headers(state, chat_req))
        resp = await until_disconnect(request, chat_response(job))
        return JSONResponse(anthropic.from_chat_response(resp.model_dump(), req).model_dump())

    @app.post(responses.PATH)
    async def create_response(request: Request) -> Response:
        check_epoch(request, state)
        body = with_header_priority(request, state,
                                    reject_unsupported(await parse_body(request),
                                                       responses.UNSUPPORTED))
        req = parse_request(responses.ResponsesRequest, body)
        try:
            chat_req = parse_request(ChatCompletionRequest, responses.to_chat_body(req, body))
            chat_req.check_tool_turns()
            job = await until_disconnect(request, prepare_chat(
                state, chat_req, request_id(request), ids_hint(request),
                resumed_ids(request, state)))
        except InvalidRequestError as exc:  # name the field as the Responses client wrote it
            exc.param = responses.responses_param(exc.param)
            raise
        if req.stream:
            translator = responses.StreamTranslator(req, job.model)  # the served name
            if job.replayed is not None:  # a resumed stream: its events were sent before
                translator.replay(job.replayed.model_dump(exclude_none=True))
            return SSEResponse(translated_sse(chat_chunks(job), translator, responses.sse),
                               _ids_headers(state, chat_req))
        resp = await until_disconnect(request, chat_response(job))
        return JSONResponse(responses.from_chat_response(resp.model_dump(), req))

    @app.post(responses.INPUT_TOKENS_PATH)  # (before the stored-response routes below)
    async def input_tokens(request: Request) -> dict[str, Any]:
        body = reject_unsupported(await parse_body(request), responses.UNSUPPORTED)
        req = parse_request(responses.InputTokensRequest, body)
        try:
            prompt = parse_request(TokenizeRequest, responses.prompt_body(req, body))
            count = _tokenize(state, prompt)["count"]
        except InvalidRequestError as exc:  # name the field as the Responses client wrote it
            exc.param = responses.responses_param(exc.param)
            raise
        return {"object": "response.input_tokens", "input_tokens": count}

    for path in responses.STORED_PATHS:
        app.add_route(path, responses.stored_response, methods=["GET", "POST", "DELETE"],
                      include_in_schema=False)

    for path, answer in pooling.ROUTES.items():
        app.add_api_route(path, _pooling_route(state, answer), methods=["POST"])

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body = await parse_body(request)
        req = parse_request(anthropic.CountTokensRequest, anthropic.reject_unsupported(body))
        try:
            prompt = parse_request(TokenizeRequest, anthropic.prompt_body(req))
            return {"input_tokens": _tokenize(state, prompt)["count"]}
        except InvalidRequestError as exc:  # name the field as the Anthropic client wrote it
            exc.param = anthropic.anthropic_param(exc.param)
            raise

    def cards() -> list[ModelCard]:
        engine = state.require_engine()
        served = [ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
                  for name in state.served_names]
        return served + state.loras.cards(state.model_name, engine.max_model_len)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=cards()).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        card = next((c for c in cards() if c.id == model_id), None)
        if card is None:
            raise NotFoundError(f"The model `{model_id}` does not exist.", param="model")
        return card.model_dump()

    add_lora_routes(app, state)
    add_pd_routes(app, state)

    @app.get("/health")
    async def health() -> Response:
        if state.engine is not None and state.engine.dead is not None:
            return JSONResponse({"status": "dead", "error": state.engine.dead.message},
                                status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503,
                                headers={"Retry-After": "1"})
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's `GET /version`: the server's version."""
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return _tokenize(state, parse_request(TokenizeRequest, await parse_body(request)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = parse_request(DetokenizeRequest, await parse_body(request))
        state.check_model(req.model)
        tok = state.require_engine().tokenizer
        ids = check_token_ids(req.tokens, tok.vocab_size, "tokens")
        return DetokenizeResponse(prompt=tok.decode(ids, skip_special_tokens=False)).model_dump()


def _tokenize(state: WorkerState, req: TokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    engine = state.require_engine()
    tok = engine.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of 'prompt' or 'messages'", param="prompt")
    if req.tools is not None and req.messages is None:
        raise InvalidRequestError("'tools' goes with 'messages'", param="tools")
    if req.messages is not None:
        tools = [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None
        check_continue(req.continue_final_message, req.add_generation_prompt)
        text = chat_prompt(tok, req.messages, req.add_generation_prompt, tools,
                           req.continue_final_message, req.chat_template_kwargs)
        ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
    else:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok.encode(req.prompt or "", add_special_tokens=special)
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                            token_strs=strs).model_dump(exclude_none=True)


# --------------------------------------------------------------------------- helpers


async def parse_body(request: Request) -> dict[str, Any]:
    """The JSON object in the request body; anything else (bad JSON, nesting too deep, a
    lone surrogate) is a 400, a body over the limit a 413 (`BodyLimit`)."""
    return load_json_object(await request.body(), param="body")


def ids_hint(request: Request) -> IdsHint | None:
    """The prompt's token ids as the router computed them (`x-sluice-prompt-ids`)."""
    value = request.headers.get(IDS_HEADER)
    return IdsHint.decode(value) if value else None


def resumed_ids(request: Request, state: WorkerState) -> list[int] | None:
    """The output a migrated stream already sent (`x-sluice-resume-ids`, set by the
    router; None for a request that is not resumed, which may be [] when the failed
    worker sent no token); a 400 when malformed or of another tokenizer than this one."""
    value = request.headers.get(RESUME_HEADER)
    if value is None:
        return None
    resume = ResumeIds.decode(value)
    if resume is None or resume.fingerprint != fingerprint(state.require_engine().tokenizer):
        raise InvalidRequestError("the resumed token ids are malformed or of another "
                                  "tokenizer", param=RESUME_HEADER)
    return resume.ids


def _ids_headers(state: WorkerState, req: SamplingFields) -> dict[str, str]:
    """With `return_token_ids`: this worker's tokenizer fingerprint, so a router can
    resume the stream on a worker with the same tokenizer (`x-sluice-resume-ids`)."""
    if not req.return_token_ids:
        return {}
    return {TOKENIZER_HEADER: fingerprint(state.require_engine().tokenizer)}


def _pooling_route(state: WorkerState, answer: pooling.Answer
                   ) -> Callable[[Request], Awaitable[Response]]:
    """A route answered with embeddings (`worker/embeddings.py`): `answer` is the request
    model it reads and the function that answers it."""
    model, respond = answer

    async def route(request: Request) -> Response:
        check_epoch(request, state)
        body = with_header_priority(request, state, await parse_body(request))
        req = parse_request(model, body)
        return JSONResponse(await until_disconnect(request, respond(
            state, req, request_id(request), ids_hint(request))))

    return route


def request_id(request: Request) -> str:
    return str(request.scope["state"]["request_id"])


PRIORITY_HEADER = "x-sluice-priority"


def header_priority(request: Request, state: WorkerState) -> int | None:
    """The gateway's priority for a request (its tenant's class): the `x-sluice-priority`
    header, an integer, lower runs first; a `priority` in the body wins. None under the
    fcfs policy: the class is a hint the gateway sends every worker, which a worker that
    does not schedule by priority ignores (a `priority` in the body is the client's own,
    and is refused there as vLLM refuses it)."""
    value = request.headers.get(PRIORITY_HEADER)
    if value is None or state.require_engine().inputs.info.scheduling_policy != "priority":
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"{PRIORITY_HEADER} must be an integer, got {value!r}",
                                  param=PRIORITY_HEADER) from None


def with_header_priority(request: Request, state: WorkerState,
                         body: dict[str, Any]) -> dict[str, Any]:
    """`body` with the gateway's class priority (`header_priority`) where it has none."""
    if "priority" not in body and (priority := header_priority(request, state)) is not None:
        body["priority"] = priority
    return body


async def _json(result: Awaitable[BaseModel]) -> JSONResponse:
    return JSONResponse((await result).model_dump())


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it if the client disconnects first (which aborts its Run:
    a request waiting for its first token is aborted in the engine, not left to run)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected("the client disconnected")
    return task.result()


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse_data(payload: str) -> str:
    return f"data: {payload}\n\n"


async def openai_sse(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """OpenAI's SSE framing; an error mid-stream is sent as a data event, then [DONE]."""
    try:
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                yield _sse_data(chunk.model_dump_json())
    except SluiceError as exc:
        yield _sse_data(json.dumps(exc.to_dict()))
    except Exception as exc:
        log.exception("stream failed")
        yield _sse_data(json.dumps(SluiceError(f"internal error: {exc}").to_dict()))
    yield _sse_data("[DONE]")


class Translator(Protocol):
    """A stream translator from OpenAI chat chunks to another API's events
    (`anthropic.StreamTranslator`, `responses.StreamTranslator`)."""

    def start(self) -> list[Any]: ...
    def feed(self, chunk: dict[str, Any]) -> list[Any]: ...
    def finish(self) -> list[Any]: ...
    def failed(self, exc: SluiceError) -> list[Any]: ...


async def translated_sse(chunks: AsyncIterator[BaseModel], translator: Translator,
                         sse: Callable[[Any], str]) -> AsyncIterator[str]:
    """Another API's SSE events (`sse` frames one), translated from OpenAI chat chunks;
    an error mid-stream ends the stream with that API's error event."""
    try:
        for event in translator.start():
            yield sse(event)
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                for event in translator.feed(chunk.model_dump()):
                    yield sse(event)
        for event in translator.finish():
            yield sse(event)
    except Exception as exc:
        if not isinstance(exc, SluiceError):
            log.exception("stream failed")
            exc = SluiceError(f"internal error: {exc}")
        for event in translator.failed(exc):
            yield sse(event)


class SSEResponse(StreamingResponse):
    """A text/event-stream response that stops as soon as the client disconnects (it
    listens for `http.disconnect` beside the stream, whatever the server's ASGI spec
    version) and always closes its body iterator, so the request's `Run` aborts the
    engine request at once."""

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None
                 ) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **(headers or {})})
        self._source = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream_then_stop() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await _wait_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._source.aclose()  # type: ignore[attr-defined]


class RequestIdMiddleware:
    """Honours `x-request-id` (else makes one), exposes it in scope state, echoes it back."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1").strip() or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# --------------------------------------------------------------------------- errors


def _error_response(request: Request, exc: SluiceError) -> JSONResponse:
    anthropic_path = request.url.path in ANTHROPIC_PATHS
    body = anthropic.error_body(exc) if anthropic_path else exc.to_dict()
    if request.url.path in KIND_OF_PATH:  # a generation request refused before its answer
        metrics = request.app.state.worker.metrics
        metrics.rejected.labels(metrics.model_name(), exc.code or exc.error_type).inc()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def _sluice_error(request: Request, exc: SluiceError) -> JSONResponse:
    return _error_response(request, exc)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _error_response(request, http_status_error(exc.status_code, str(exc.detail),
                                                      request.method, request.url.path))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    return _error_response(request, SluiceError(f"internal error: {type(exc).__name__}"))
