"""`/v1/models` through the gateway shows only the models the calling key may use.

Real HTTP: the gateway under uvicorn in front of the stub upstream, which lists three
models; the official `openai` SDK and raw httpx as clients.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import KeySettings, SQLStore, UsageQuery

from .conftest import make_state, new_key, serve
from .stub import StubUpstream

MODELS = ("small", "medium", "large")


@pytest.fixture
def upstream() -> StubUpstream:
    return StubUpstream(model_ids=MODELS)


async def test_restricted_key_lists_and_retrieves_only_its_models(
        sqlite_store: SQLStore, upstream: StubUpstream) -> None:
    # tenant allows small + medium; the key narrows to medium + large: only medium is left
    key = new_key(sqlite_store, key_settings=KeySettings(allowed_models=("medium", "large")),
                  allowed_models=("small", "medium"))
    gw = GatewayMiddleware(upstream, make_state(sqlite_store))
    async with serve(gw) as url:
        client = openai.AsyncOpenAI(api_key=key, base_url=url + "/v1", max_retries=0)
        listed = await client.models.list()
        assert [m.id for m in listed.data] == ["medium"]
        assert (await client.models.retrieve("medium")).id == "medium"
        for hidden in ("small", "large", "absent"):
            with pytest.raises(openai.NotFoundError):
                await client.models.retrieve(hidden)
        async with httpx.AsyncClient(base_url=url, timeout=10,
                                     headers={"Authorization": f"Bearer {key}"}) as raw:
            r = await raw.get("/v1/models")
            assert r.status_code == 200 and r.json()["object"] == "list"
            assert int(r.headers["content-length"]) == len(r.content)
            assert r.json()["data"] == [{"id": "medium", "object": "model", "created": 0,
                                         "owned_by": "stub"}]
            r = await raw.get("/v1/models/large")
            assert r.status_code == 404
            error = r.json()["error"]
            assert error["code"] == "model_not_found" and "large" in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
    records = [(r.endpoint, r.status) for r in sqlite_store.query_usage(UsageQuery())]
    assert ("/v1/models/large", "rejected") in records


async def test_unrestricted_key_sees_every_model(sqlite_store: SQLStore,
                                                 upstream: StubUpstream) -> None:
    key = new_key(sqlite_store)
    gw = GatewayMiddleware(upstream, make_state(sqlite_store))
    async with serve(gw) as url:
        client = openai.AsyncOpenAI(api_key=key, base_url=url + "/v1", max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == list(MODELS)
        assert (await client.models.retrieve("large")).id == "large"
        with pytest.raises(openai.NotFoundError):  # the upstream's own 404, passed through
            await client.models.retrieve("absent")


async def test_tenant_list_alone_restricts_the_listing(sqlite_store: SQLStore,
                                                       upstream: StubUpstream) -> None:
    key = new_key(sqlite_store, allowed_models=("large", "small"))
    gw = GatewayMiddleware(upstream, make_state(sqlite_store))
    async with serve(gw) as url:
        client = openai.AsyncOpenAI(api_key=key, base_url=url + "/v1", max_retries=0)
        assert [m.id for m in (await client.models.list()).data] == ["small", "large"]


async def test_count_tokens_applies_the_allow_list_and_records_the_model(
        sqlite_store: SQLStore, upstream: StubUpstream) -> None:
    # Anthropic's token counting names a model: a key may count only for models it may
    # use, and the ledger row names the model; it reserves and records no tokens
    key = new_key(sqlite_store, allowed_models=("small",))
    gw = GatewayMiddleware(upstream, make_state(sqlite_store))
    messages = [{"role": "user", "content": "hi"}]
    async with serve(gw) as url:
        client = anthropic.AsyncAnthropic(api_key=key, base_url=url, max_retries=0)
        counted = await client.messages.count_tokens(model="small", messages=messages)
        assert counted.input_tokens == 7  # the stub's count, passed through
        with pytest.raises(anthropic.NotFoundError) as refused:
            await client.messages.count_tokens(model="large", messages=messages)
        assert refused.value.body["error"]["type"] == "not_found_error"
    assert [b["model"] for b in upstream.received] == ["small"]  # the refused one stayed
    rows = sorted((r.model or "", r.status, r.prompt_tokens, r.completion_tokens)
                  for r in sqlite_store.query_usage(UsageQuery())
                  if r.endpoint == "/v1/messages/count_tokens")
    assert rows == [("large", "rejected", 0, 0), ("small", "ok", 0, 0)]
