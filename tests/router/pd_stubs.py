"""Stub workers that play vLLM's side of prefill/decode disaggregation (`kv_transfer_params`).

A prefill request must carry exactly vLLM's request fields (`do_remote_decode: true`,
`do_remote_prefill: false`, `remote_engine_id`, `remote_block_ids`, `remote_host`,
`remote_port`: null), `max_tokens: 1`, `stream: false`, no `stream_options`; the stub
answers a completion with exactly vLLM's response fields (`do_remote_prefill: true`,
`do_remote_decode: false`, `remote_engine_id`, `remote_block_ids`, `remote_host`,
`remote_port`, `remote_request_id`, `tp_size`) and keeps the prompt's "KV" in the shared
`KVStore`. A decode request must carry those fields unchanged; the stub "pulls" the KV
(the prompt must match what the prefill held) and generates. A violation answers 400
with the reason and is recorded in `errors`, so a test fails on it.

Output is a function of the prompt only (`answer`), so a disaggregated answer equals a
local one. With `pd_api` the stub serves `GET/POST /v1/pd_role` with epoch fencing
(the RFC's shape) and answers 409 `stale_pd_epoch` to an `x-sluice-pd-epoch` header
that is not its epoch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from router_stubs import prompt_ids
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

REQUEST_FIELDS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}
RESPONSE_FIELDS = {"do_remote_prefill", "do_remote_decode", "remote_engine_id",
                   "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
                   "tp_size"}


@dataclass
class KVStore:
    """The prefill workers' held KV, by remote_request_id (what a decode pulls)."""

    held: dict[str, list[int]] = field(default_factory=dict)
    ids: Any = field(default_factory=lambda: itertools.count(1))


@dataclass
class PDStub:
    name: str
    store: KVStore
    role: str = "both"
    pd_api: bool = False  # serves /v1/pd_role (sluice); False: vLLM (no such endpoint)
    epoch: int = 0
    num_tokens: int = 4
    token_delay_s: float = 0.0
    fail_status: int | None = None  # every generation request
    fail_pull: bool = False  # decode: 503 kv_transfer_failed
    prefills: list[dict[str, Any]] = field(default_factory=list)
    decodes: list[dict[str, Any]] = field(default_factory=list)
    locals: list[dict[str, Any]] = field(default_factory=list)
    epochs_seen: list[str | None] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stale: int = 0
    running: int = 0
    url: str = ""  # set by the test once it serves
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA: name -> path (vLLM's
    # /v1/models entries with a `parent`; POST /v1/load_lora_adapter adds one)


def answer(body: dict[str, Any], n: int) -> list[str]:
    """The stub's deterministic output for a prompt: a function of the prompt only."""
    ids = prompt_ids(body)
    return [f"t{(sum(ids) + i) % 97}" for i in range(n)]


def _bad(stub: PDStub, reason: str) -> Response:
    stub.errors.append(reason)
    return JSONResponse({"error": {"message": reason, "type": "invalid_request_error",
                                   "param": "kv_transfer_params", "code": None}},
                        status_code=400)


def _prefill(stub: PDStub, body: dict[str, Any], chat: bool) -> Response:
    params = body["kv_transfer_params"]
    if params != REQUEST_FIELDS:
        return _bad(stub, f"prefill kv_transfer_params are not vLLM's: {params}")
    if body.get("max_tokens") != 1 or body.get("stream") is not False \
            or "stream_options" in body or body.get("max_completion_tokens", 1) != 1:
        return _bad(stub, f"prefill request not as vLLM's proxy sends it: {body}")
    stub.prefills.append(body)
    request_id = f"{stub.name}-{next(stub.store.ids)}"
    stub.store.held[request_id] = prompt_ids(body)
    out = {"do_remote_prefill": True, "do_remote_decode": False,
           "remote_engine_id": f"engine-{stub.name}", "remote_block_ids": [1, 2, 3],
           "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": request_id,
           "tp_size": 1}
    return JSONResponse(_completion(stub, body, chat, answer(body, 1)) | {"kv_transfer_params": out})


def _completion(stub: PDStub, body: dict[str, Any], chat: bool, words: list[str]
                ) -> dict[str, Any]:
    text = " ".join(words)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
              else {"index": 0, "text": text})
    return {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion",
            "model": body.get("model"), "worker": stub.name,
            "choices": [{**choice, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt_ids(body)), "completion_tokens": len(words)}}


async def _stream(stub: PDStub, body: dict[str, Any], chat: bool, words: list[str]
                  ) -> AsyncIterator[bytes]:
    stub.running += 1
    try:
        for i, w in enumerate(words):
            if i:
                await asyncio.sleep(stub.token_delay_s)
            piece = w + " "
            choice = ({"index": 0, "delta": {"content": piece}} if chat
                      else {"index": 0, "text": piece})
            chunk = {"id": "cmpl-1", "model": body.get("model"), "worker": stub.name,
                     "choices": [{**choice, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    finally:
        stub.running -= 1


def make_pd_stub(stub: PDStub) -> Starlette:
    async def generate(request: Request) -> Response:
        body = await request.json()
        if body.get("model") not in ("stub-model", *stub.adapters):  # vLLM's 404
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` "
                                           "does not exist.", "type": "NotFoundError",
                                           "param": "model", "code": 404}}, status_code=404)
        chat = request.url.path.endswith("chat/completions")
        epoch = request.headers.get("x-sluice-pd-epoch")
        stub.epochs_seen.append(epoch)
        if stub.pd_api and epoch is not None and int(epoch) != stub.epoch:
            stub.stale += 1
            return JSONResponse({"error": {"message": f"epoch {epoch} is stale ({stub.epoch})",
                                           "type": "conflict_error", "param": None,
                                           "code": "stale_pd_epoch"}}, status_code=409)
        if stub.fail_status is not None:
            return JSONResponse({"error": {"message": "injected"}}, status_code=stub.fail_status)
        params = body.get("kv_transfer_params")
        if params is not None and params.get("do_remote_decode"):
            return _prefill(stub, body, chat)
        if params is not None:
            if set(params) != RESPONSE_FIELDS or params.get("do_remote_prefill") is not True:
                return _bad(stub, f"decode kv_transfer_params are not vLLM's: {params}")
            if stub.fail_pull:
                return JSONResponse({"error": {"message": "KV pull failed",
                                               "type": "service_unavailable", "param": None,
                                               "code": "kv_transfer_failed"}}, status_code=503)
            held = stub.store.held.pop(params["remote_request_id"], None)
            if held != prompt_ids(body):
                return _bad(stub, "decode prompt does not match the prefilled KV")
            stub.decodes.append(body)
        else:
            stub.locals.append(body)
        words = answer(body, int(body.get("max_tokens") or stub.num_tokens))
        if body.get("stream"):
            return StreamingResponse(_stream(stub, body, chat, words),
                                     media_type="text/event-stream")
        return JSONResponse(_completion(stub, body, chat, words))

    async def pd_role(request: Request) -> Response:
        if not stub.pd_api:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        if request.method == "POST":
            body = await request.json()
            if body.get("expected_epoch") != stub.epoch:
                return JSONResponse({"error": {"message": "stale epoch", "code": "stale_pd_epoch",
                                               "type": "conflict_error", "param": "expected_epoch"}},
                                    status_code=409)
            stub.role = body["role"]
            stub.epoch += 1
        return JSONResponse({"role": stub.role, "epoch": stub.epoch, "draining": False})

    async def health(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def models(_: Request) -> Response:
        data = [{"id": "stub-model", "object": "model"}]
        data += [{"id": n, "object": "model", "root": path, "parent": "stub-model"}
                 for n, path in stub.adapters.items()]
        return JSONResponse({"object": "list", "data": data})

    async def load_lora(request: Request) -> Response:
        body = await request.json()
        stub.adapters[body["lora_name"]] = body["lora_path"]
        return PlainTextResponse("Success")

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(f"vllm:num_requests_running {stub.running}\n"
                                 "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.1\n")

    async def tokenize(request: Request) -> Response:
        ids = prompt_ids(await request.json())
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    return Starlette(routes=[
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/pd_role", pd_role, methods=["GET", "POST"]),
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/load_lora_adapter", load_lora, methods=["POST"]),
    ])
