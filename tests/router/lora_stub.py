"""A stub worker with vLLM's LoRA surface, for router placement tests and benchmarks/lora_routing.py.

Serves /health, /v1/models (the base model and each registered adapter with `parent` and
`content_hash`),
/metrics (`vllm:num_requests_*` and `vllm:lora_requests_info{max_lora}`), /tokenize,
`POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (vLLM's messages and codes), and
/v1/chat/completions (JSON or SSE). A request for an unregistered adapter gets vLLM's 404.

Like an engine, it keeps the weights of at most `max_loras` adapters (LRU): a request
whose adapter is not among them first pays `load_s` (reading the weights) and evicts the
least recently used; `weight_loads` counts those reads. `max_num_seqs` requests run at
once, each for `service_s` (the rest wait their turn), so a busy stub queues like a worker.
Answers are deterministic: "<model> says <n words>".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class LoraStub:
    name: str
    model: str = "base"
    max_loras: int = 2
    load_s: float = 0.0  # seconds to read an adapter's weights (an LRU miss)
    service_s: float = 0.0  # seconds a request runs once admitted
    max_num_seqs: int = 8
    lora_enabled: bool = True  # False: loads refused, as a worker without --enable-lora
    tokenize_refused: int = 0  # /tokenize calls for a model it does not serve (404)
    adapters: dict[str, str] = field(default_factory=dict)  # registered: name -> path
    weights: OrderedDict[str, None] = field(default_factory=OrderedDict)  # LRU of loaded
    weight_loads: int = 0
    load_calls: int = 0
    unload_calls: int = 0
    served: list[str] = field(default_factory=list)  # the model of each request
    ttfts: list[float] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    _slots: asyncio.Semaphore | None = None

    def restart(self) -> None:
        """What a restarted worker looks like: runtime-loaded adapters and weights gone."""
        self.adapters.clear()
        self.weights.clear()

    async def _run(self, model: str) -> float:
        """Wait for a slot, read the adapter's weights if needed, serve; returns the TTFT."""
        start = time.perf_counter()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_num_seqs)
        self.waiting += 1
        async with self._slots:
            self.waiting -= 1
            self.running += 1
            try:
                if model != self.model:
                    if model in self.weights:
                        self.weights.move_to_end(model)
                    else:
                        self.weight_loads += 1
                        if len(self.weights) >= self.max_loras:
                            self.weights.popitem(last=False)
                        self.weights[model] = None
                        await asyncio.sleep(self.load_s)
                ttft = time.perf_counter() - start
                await asyncio.sleep(self.service_s)
            finally:
                self.running -= 1
        return ttft

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload, methods=["POST"]),
            Route("/v1/models", self.models), Route("/health", self.health),
            Route("/metrics", self.metrics), Route("/tokenize", self.tokenize, methods=["POST"]),
        ])

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        model = body.get("model")
        if model != self.model and model not in self.adapters:
            return JSONResponse({"error": {"message": f"The model `{model}` does not exist.",
                                           "type": "NotFoundError", "param": "model",
                                           "code": 404}}, status_code=404)
        self.served.append(model)
        ttft = await self._run(model)
        self.ttfts.append(ttft)
        words = len(str(body["messages"][-1]["content"]).split())
        text = f"{model} says {words}"
        if body.get("stream"):
            return StreamingResponse(self._stream(model, text), media_type="text/event-stream")
        return JSONResponse({"id": "x", "object": "chat.completion", "model": model,
                             "worker": self.name, "choices": [{
                                 "index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                             "usage": {"prompt_tokens": words, "completion_tokens": 3,
                                       "total_tokens": words + 3}})

    async def _stream(self, model: str, text: str) -> AsyncIterator[bytes]:
        for piece in text.split():
            chunk = {"id": "x", "model": model, "choices": [
                {"index": 0, "delta": {"content": piece + " "}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def load(self, request: Request) -> Response:
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        self.load_calls += 1
        if not name or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", 400)
        if not self.lora_enabled:
            return _error("LoRA is not enabled on this worker (--enable-lora)", 400)
        if name in self.adapters:
            return _error(f"The lora adapter '{name}' has already been loaded.", 400)
        self.adapters[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        name = (await request.json()).get("lora_name")
        self.unload_calls += 1
        if self.adapters.pop(name, None) is None:
            return _error(f"The lora adapter '{name}' cannot be found.", 404)
        self.weights.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def models(self, _: Request) -> Response:
        data = [{"id": self.model, "object": "model", "root": self.model, "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": self.model,
                  "content_hash": content_hash(p)} for n, p in self.adapters.items()]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, _: Request) -> Response:
        return PlainTextResponse("ok")

    async def metrics(self, _: Request) -> Response:
        running = ",".join(self.weights)
        return PlainTextResponse(
            f'vllm:num_requests_running{{model_name="{self.model}"}} {self.running}\n'
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} {self.waiting}\n'
            f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters='
            f'"{running}",waiting_lora_adapters=""}} {time.time()}\n')

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        model = body.get("model")
        if model is not None and model != self.model and model not in self.adapters:
            self.tokenize_refused += 1  # as a worker does: a model it does not serve
            return _error(f"The model `{model}` does not exist.", 404)
        text = " ".join(str(m.get("content", "")) for m in body.get("messages", [])) \
            or str(body.get("prompt", ""))
        ids = [zlib.crc32(w.encode()) % 30000 for w in text.split()]
        return JSONResponse({"count": len(ids), "max_model_len": 4096, "tokens": ids})


def _error(message: str, status: int) -> Response:
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


def content_hash(path: str) -> str:
    """The stub's stand-in for an adapter's content hash (the engine hashes the weights)."""
    return hashlib.sha256(path.encode()).hexdigest()


def chat(model: str, words: int = 8, salt: int = 0, **extra: Any) -> dict[str, Any]:
    """A chat request of `words` words; a different `salt`, a prompt with no shared prefix."""
    text = " ".join(f"w{salt}x{i}" for i in range(words))
    return {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}],
            **extra}
