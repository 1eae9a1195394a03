"""Aliases and the cascade (router/cascade.py): constructed cases, real HTTP, stub workers."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from tests.gateway.conftest import client_for, make_state, new_key
from tests.router.router_stubs import serve, serve_router

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.pricing import PriceTable
from sluice.gateway.store import KeySettings, SQLStore, UsageQuery
from sluice.protocol.errors import InvalidRequestError
from sluice.router.app import build_app
from sluice.router.cascade import Classifier, features
from sluice.router.config import (
    AliasSpec,
    CascadeSpec,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
)

TOKENS = ["one", "two", "three", "four"]


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SQLStore]:
    store = SQLStore(f"sqlite:///{tmp_path / 'gw.db'}")
    yield store
    store.close()


class ModelStub:
    """Answers as `model`; each token's logprob is -3.0 if the prompt says "unsure",
    else -0.1, reported only when asked (chat `logprobs: true`)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/models", self.models), Route("/health", self.health),
            Route("/metrics", self.health)])

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if body.get("model") != self.model:  # as a worker: a model it does not serve
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        return JSONResponse({"count": 2, "max_model_len": 4096, "tokens": [1, 2]})

    async def health(self, _: Request) -> Response:
        return PlainTextResponse("")

    async def models(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model}]})

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        lp = -3.0 if "unsure" in body["messages"][-1]["content"] else -0.1
        asked = bool(body.get("logprobs"))
        usage = {"prompt_tokens": 5, "completion_tokens": len(TOKENS), "total_tokens": 9}
        if body.get("stream"):
            return StreamingResponse(self._stream(lp, asked), media_type="text/event-stream")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop",
                                  "message": {"role": "assistant", "content": " ".join(TOKENS)}}
        if asked:
            choice["logprobs"] = {"content": [{"token": t, "logprob": lp} for t in TOKENS]}
        return JSONResponse({"id": "x", "object": "chat.completion", "model": self.model,
                             "choices": [choice], "usage": usage})

    async def _stream(self, lp: float, asked: bool) -> AsyncIterator[bytes]:
        for t in TOKENS:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": t}, "finish_reason": None}
            if asked:
                choice["logprobs"] = {"content": [{"token": t, "logprob": lp}]}
            yield f"data: {json.dumps({'id': 'x', 'model': self.model, 'choices': [choice]})}\n\n".encode()
        yield b"data: [DONE]\n\n"


CASCADE = CascadeSpec(small="small", large="large", keywords=("prove",),
                      classifier="builtin", min_mean_logprob=-1.0, hold_tokens=2,
                      max_prompt_tokens=200)


@asynccontextmanager
async def cascade_router() -> AsyncIterator[tuple[str, ModelStub, ModelStub, Any]]:
    small, large = ModelStub("small"), ModelStub("large")
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(s.app())) for s in (small, large)]
        config = RouterConfig(
            pools=(PoolConfig(model="small", workers=(WorkerSpec(urls[0]),), policy="least_load"),
                   PoolConfig(model="large", workers=(WorkerSpec(urls[1]),), policy="least_load")),
            aliases=(AliasSpec("auto", cascade=CASCADE), AliasSpec("fast", target="small")),
            health_interval_s=0.1, scrape_interval_s=0.1, seed=0)
        app = build_app(config, rng=random.Random(0))
        router = await stack.enter_async_context(serve_router(app))
        yield router, small, large, app


def ask(content: str, model: str = "auto", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


@pytest.mark.parametrize("content, served, why", [
    ("What is the capital of France?", "small", "small; logprob -0.100"),
    ("What is the capital of France? unsure", "large", "large; logprob -3.000"),
    ("Please prove it", "large", "large; keyword"),
    ("Derive the closed form of the sum of the first n cubes and prove it by induction.",
     "large", "large; keyword"),
    ("Write a Python function that finds the longest palindromic substring and explain "
     "its complexity.", "large", "large; classifier"),
    ("word " * 300, "large", "large; length"),
])
async def test_non_streamed_escalation_is_deterministic(content: str, served: str,
                                                        why: str) -> None:
    async with cascade_router() as (router, small, large, _), \
            httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=ask(content))
        assert r.status_code == 200
        assert r.json()["model"] == served and r.headers["x-sluice-served-model"] == served
        assert r.headers["x-sluice-cascade"] == why
        assert "logprobs" not in r.json()["choices"][0]  # the client did not ask
        prompt_rule = why.split("; ")[1] in ("keyword", "classifier", "length")
        assert len(small.bodies) == (0 if prompt_rule else 1)
        assert len(large.bodies) == (1 if served == "large" else 0)
        if small.bodies:
            assert small.bodies[0]["logprobs"] is True  # asked on the client's behalf


async def test_streamed_holds_the_first_tokens_then_passes_or_escalates() -> None:
    async with cascade_router() as (router, small, large, _), \
            httpx.AsyncClient(base_url=router) as c:
        for content, served in (("hello there", "small"), ("hello unsure", "large")):
            async with c.stream("POST", "/v1/chat/completions",
                                json=ask(content, stream=True)) as s:
                assert s.headers["x-sluice-served-model"] == served
                events = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert "".join(ch["choices"][0]["delta"]["content"] for ch in chunks) == "".join(TOKENS)
            assert {ch["model"] for ch in chunks} == {served}
            assert all("logprobs" not in ch["choices"][0] for ch in chunks)
        assert len(small.bodies) == 2 and len(large.bodies) == 1


def requests_total(metrics: str) -> dict[str, float]:
    """`sluice_router_requests_total` by its labels as /metrics writes them."""
    prefix = "sluice_router_requests_total{"
    return {line[len(prefix):].split("}")[0]: float(line.split()[-1])
            for line in metrics.splitlines() if line.startswith(prefix)}


async def test_a_cascade_request_is_counted_once_by_the_model_asked() -> None:
    """One client request, one count, by the model the client named and the status it
    got (docs/router.md, Metrics): an escalated request was counted once per model the
    cascade tried (`small` and `large`, 200 each), a plain alias's by its target."""
    async with cascade_router() as (router, small, large, _), \
            httpx.AsyncClient(base_url=router) as c:
        for content in ("hi", "hi unsure", "please prove it"):  # small; escalated; large
            assert (await c.post("/v1/chat/completions", json=ask(content))).status_code == 200
        async with c.stream("POST", "/v1/chat/completions",
                            json=ask("hello unsure", stream=True)) as s:  # escalated
            assert s.headers["x-sluice-served-model"] == "large"
            await s.aread()
        assert (await c.post("/v1/chat/completions", json=ask("hi", model="fast"))
                ).status_code == 200  # a plain alias: by its name too
        counted = requests_total((await c.get("/metrics")).text)
    assert (len(small.bodies), len(large.bodies)) == (4, 3)  # what the aliases tried
    assert counted == {'model="auto",status="200"': 4.0, 'model="fast",status="200"': 1.0}, \
        counted


async def test_client_asked_logprobs_are_kept_and_a_plain_alias_is_rewritten() -> None:
    async with cascade_router() as (router, small, _, _), httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/v1/chat/completions", json=ask("hi", logprobs=True))
        assert len(r.json()["choices"][0]["logprobs"]["content"]) == len(TOKENS)
        r = await c.post("/v1/chat/completions", json=ask("hi", model="fast"))
        assert r.json()["model"] == "small" and small.bodies[-1]["model"] == "small"
        listed = {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
        assert {"auto", "fast", "small", "large"} <= listed


async def test_tokenize_with_an_alias_reaches_its_target() -> None:
    """POST /tokenize (and /detokenize) with a router-wide alias are its target's, as
    /v1/chat/completions is; they were a 404 'The model `fast` does not exist' for a
    name /v1/models lists. A cascade has two models: 400 naming model."""
    async with cascade_router() as (router, small, _, _), httpx.AsyncClient(base_url=router) as c:
        r = await c.post("/tokenize", json={"model": "fast", "prompt": "a b"})
        assert r.status_code == 200 and r.json()["count"] == 2, r.text
        assert small.bodies[-1]["model"] == "small"
        r = await c.post("/tokenize", json={"model": "auto", "prompt": "a b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


async def test_the_gateway_ledger_records_and_prices_the_serving_model(sqlite_store: Any) -> None:
    prices = PriceTable.from_mapping({"small": {"input_per_million": 1, "output_per_million": 1},
                                      "large": {"input_per_million": 10,
                                                "output_per_million": 10}})
    async with cascade_router() as (_, _, _, app):  # its lifespan runs under the server
        gateway = GatewayMiddleware(app, make_state(sqlite_store, prices=prices))
        key = new_key(sqlite_store)
        async with client_for(gateway, key) as c:
            assert (await c.post("/v1/chat/completions", json=ask("hi"))).status_code == 200
            assert (await c.post("/v1/chat/completions",
                                 json=ask("hi unsure"))).status_code == 200
    rows = [asdict(r) for r in sqlite_store.query_usage(UsageQuery())]
    models = sorted(r["model"] for r in rows)
    assert models == ["large", "small"]
    cost = {r["model"]: r["cost_usd"] for r in rows}
    assert cost["large"] == pytest.approx(10 * cost["small"])


async def test_a_key_limited_to_an_adapter_is_refused_another(sqlite_store: Any) -> None:
    async with cascade_router() as (_, _, _, app):
        gateway = GatewayMiddleware(app, make_state(sqlite_store))
        key = new_key(sqlite_store, key_settings=KeySettings(allowed_models=("small",)))
        async with client_for(gateway, key) as c:
            assert (await c.post("/v1/chat/completions", json=ask("hi", model="small"))
                    ).status_code == 200
            r = await c.post("/v1/chat/completions", json=ask("hi", model="large"))
            assert r.status_code == 404
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model"


def test_the_shipped_classifier_separates_the_test_split() -> None:
    data = Path(__file__).parents[2] / "src/sluice/router/data/cascade_prompts.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    test = [r for r in rows if r["split"] == "test"]
    model = Classifier.load("builtin")
    right = sum((model.p_hard(r["prompt"]) >= 0.5) == (r["label"] == "hard") for r in test)
    assert right / len(test) >= 0.9
    assert len(features("a b", 64)) == 4  # length slot, two words, one bigram
    with pytest.raises(InvalidRequestError):
        Classifier.load("/nonexistent.json")
