"""A small in-process OpenAI/Anthropic upstream for gateway tests.

Answers /v1/chat/completions, /v1/completions (JSON and SSE, honouring
`stream_options.include_usage`), /v1/messages (Anthropic JSON and SSE), /v1/models
(the names in `model_ids`), /v1/models/{id}, /health and /metrics. It records every body it receives, can hold requests on a gate
(concurrency tests), can pace stream chunks (abort tests) and can hold a JSON answer
until the client hangs up, then answer 499 as the sluice worker does (`hold_json`,
abort tests). Usage is exact and
deterministic: prompt_tokens = PROMPT_TOKENS, completion_tokens = min(max_tokens, 8).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

PROMPT_TOKENS = 7
MAX_REPLY = 8


class StubUpstream:
    def __init__(self, chunk_delay: float = 0.0, max_reply: int = MAX_REPLY,
                 model_ids: tuple[str, ...] = ("stub-model",)) -> None:
        self.model_ids = model_ids
        self.received: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.gate: asyncio.Event | None = None
        self.chunk_delay = chunk_delay
        self.max_reply = max_reply
        self.streams_finished = 0
        self.streams_cancelled = 0
        self.hold_json = False  # a non-streamed answer waits for the client to hang up
        self.json_cancelled = 0
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.chat, methods=["POST"]),
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/models", self.models),
            Route("/v1/models/{model_id:path}", self.model),
            Route("/health", self.health),
            Route("/admin/workers", self.workers),
            Route("/metrics", self.metrics),
        ])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    async def _take(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        self.received.append(body)
        self.headers.append(dict(request.headers))
        if self.gate is not None:
            await self.gate.wait()
        return body

    def _n(self, body: dict[str, Any]) -> int:
        return min(int(body.get("max_tokens") or self.max_reply), self.max_reply)

    async def chat(self, request: Request) -> Response:
        body = await self._take(request)
        if body.get("model") == "broken":
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error",
                                           "param": "model", "code": None}}, status_code=400)
        n, chat = self._n(body), request.url.path.endswith("chat/completions")
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": n,
                 "total_tokens": PROMPT_TOKENS + n}
        if body.get("stream"):
            return StreamingResponse(self._chat_stream(body, n, chat, usage),
                                     media_type="text/event-stream")
        if self.hold_json:  # "generating" until the client goes: the worker's 499
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.json_cancelled += 1
            return JSONResponse({"error": {"message": "the client disconnected", "type":
                                           "client_disconnected", "param": None,
                                           "code": None}}, status_code=499)
        text = " ".join(["tok"] * n)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length", "logprobs": None} if chat else
                  {"index": 0, "text": text, "finish_reason": "length", "logprobs": None})
        return JSONResponse({"id": "cmpl-1", "object": "chat.completion" if chat else
                             "text_completion", "created": int(time.time()),
                             "model": body.get("model"), "choices": [choice], "usage": usage})

    async def _chat_stream(self, body: dict[str, Any], n: int, chat: bool,
                           usage: dict[str, int]) -> AsyncIterator[bytes]:
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": body.get("model")}
        try:
            for i in range(n):
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                piece = "tok" if i == 0 else " tok"
                choice = ({"index": 0, "delta": {"content": piece}, "finish_reason": None}
                          if chat else {"index": 0, "text": piece, "finish_reason": None})
                if i == n - 1:
                    choice["finish_reason"] = "length"
                chunk = {**base, "choices": [choice]}
                if include:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        except BaseException:
            self.streams_cancelled += 1
            raise
        self.streams_finished += 1
        if include:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def messages(self, request: Request) -> Response:
        body = await self._take(request)
        n = self._n(body)
        if body.get("stream"):
            return StreamingResponse(self._messages_stream(body, n),
                                     media_type="text/event-stream")
        return JSONResponse({
            "id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
            "content": [{"type": "text", "text": " ".join(["tok"] * n)}],
            "stop_reason": "max_tokens", "stop_sequence": None,
            "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": n}})

    async def count_tokens(self, request: Request) -> Response:
        await self._take(request)
        return JSONResponse({"input_tokens": PROMPT_TOKENS})

    async def _messages_stream(self, body: dict[str, Any], n: int) -> AsyncIterator[bytes]:
        def event(kind: str, data: dict[str, Any]) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

        yield event("message_start", {"message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": PROMPT_TOKENS, "output_tokens": 0}}})
        yield event("content_block_start", {"index": 0,
                                            "content_block": {"type": "text", "text": ""}})
        for i in range(n):
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            yield event("content_block_delta", {"index": 0, "delta": {
                "type": "text_delta", "text": "tok" if i == 0 else " tok"}})
        yield event("content_block_stop", {"index": 0})
        yield event("message_delta", {"delta": {"stop_reason": "max_tokens",
                                                "stop_sequence": None},
                                      "usage": {"output_tokens": n}})
        yield event("message_stop", {})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "stub"}
            for m in self.model_ids]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id not in self.model_ids:
            return JSONResponse({"error": {"message": f"no model {model_id}", "type":
                                           "not_found_error", "param": None,
                                           "code": "model_not_found"}}, status_code=404)
        return JSONResponse({"id": model_id, "object": "model", "created": 0, "owned_by": "stub"})

    async def workers(self, request: Request) -> Response:  # the router's admin API
        return JSONResponse({"workers": []})

    async def health(self, request: Request) -> Response:
        return PlainTextResponse("ok")

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse("# TYPE vllm:num_requests_running gauge\n"
                                 "vllm:num_requests_running 0.0\n")
