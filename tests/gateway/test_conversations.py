"""OpenAI's Conversations API, kept by the gateway in front of a real sluice worker
(tiny random Llama, SmolLM2 tokenizer): the routes through the OpenAI SDK, Responses
turns that read and extend a conversation, tenant isolation and the errors
(gateway/conversations.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import openai
import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore
from sluice.gateway.tokens import PromptTokenCounter
from sluice.protocol.prompt import RESPONSES, prompt_view

from .conftest import PG_URL, client_for, make_state, new_key

TURN = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}


def gateway(engine: Any, store: SQLStore, counter: PromptTokenCounter,
            **config: Any) -> GatewayMiddleware:
    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    state = make_state(store, count=counter)
    state = dataclasses.replace(state, config=dataclasses.replace(state.config, **config))
    return GatewayMiddleware(build_app(engine, WorkerConfig(served_model_names=("tiny",))),
                             state)


def sdk(app: Any, key: str) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=app)
    return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, timeout=30))


async def test_a_conversation_through_the_sdk(engine: Any, counter: PromptTokenCounter,
                                              sqlite_store: SQLStore) -> None:
    """Create, read, extend and trim a conversation; two Responses turns in it (one
    streamed), each seeing every item before it and appending its own."""
    client = sdk(gateway(engine, sqlite_store, counter), new_key(sqlite_store))
    conv = await client.conversations.create(
        items=[{"type": "message", "role": "user", "content": "My name is Ada."}],
        metadata={"topic": "names"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "names"}
    assert (await client.conversations.retrieve(conv.id)).id == conv.id
    first = await client.responses.create(**TURN, input="What is my name?",
                                          conversation=conv.id)
    assert first.conversation is not None and first.conversation.id == conv.id
    items = [i async for i in client.conversations.items.list(conv.id, order="asc")]
    assert [(i.type, i.role) for i in items] == [  # type: ignore[union-attr]
        ("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[2].id == first.output[0].id
    # the whole conversation was the prompt: counted at admission as the worker saw it
    whole = {"model": "tiny", "input": [
        {"role": "user", "content": "My name is Ada."},
        {"role": "user", "content": "What is my name?"}]}
    counted = counter.prompt_tokens("tiny", prompt_view(RESPONSES, whole))
    assert counted is not None and first.usage is not None
    assert first.usage.input_tokens == counted[0]

    stream = await client.responses.create(**TURN, input="Again?", stream=True,
                                           conversation={"id": conv.id})
    events = [e async for e in stream]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.conversation.id == conv.id
    assert final.usage.input_tokens > first.usage.input_tokens
    listed = await client.conversations.items.list(conv.id, limit=2)
    assert listed.data[0].id == final.output[0].id  # newest first: its answer, its input
    assert listed.data[1].content[0].text == "Again?"  # type: ignore[union-attr]
    assert listed.has_more is True
    added = await client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "One more."}])
    one = await client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert one.id == added.data[0].id
    await client.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    remaining = [i async for i in client.conversations.items.list(conv.id)]
    assert len(remaining) == 5 and added.data[0].id not in {i.id for i in remaining}
    updated = await client.conversations.update(conv.id, metadata={"topic": "other"})
    assert updated.metadata == {"topic": "other"}
    deleted = await client.conversations.delete(conv.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(**TURN, input="x", conversation=conv.id)


async def test_conversations_are_a_tenants_own_and_errors_name_the_field(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    gw = gateway(engine, sqlite_store, counter)
    mine, theirs = new_key(sqlite_store, "acme"), new_key(sqlite_store, "other")
    async with client_for(gw, mine) as c:
        conv = (await c.post("/v1/conversations", json={})).json()
        turn = (await c.post("/v1/responses", json={**TURN, "input": "hi"})).json()
        bad = [
            ({"items": [{"type": "web_search_call"}]}, "items.0.type"),
            ({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
            ({"metadata": {"k": 1}}, "metadata"),
            ({"title": "x"}, "title"),
        ]
        for body, param in bad:
            r = await c.post("/v1/conversations", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = await c.post("/v1/conversations", content=b"[1]")
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = await c.post("/v1/responses", json={**TURN, "input": "x", "conversation": conv["id"],
                                                "previous_response_id": turn["id"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"
        r = await c.post("/v1/responses", json={**TURN, "input": "x", "conversation": 7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "conversation"
        r = await c.post("/v1/responses", json={**TURN, "input": "x",
                                                "conversation": "conv_nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "conversation"
        r = await c.get(f"/v1/conversations/{conv['id']}/items/msg_nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "item_not_found"
        r = await c.get(f"/v1/conversations/{conv['id']}/items", params={"limit": 101})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
        r = await c.post(f"/v1/conversations/{conv['id']}", json={})
        assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
        r = await c.post(f"/v1/conversations/{conv['id']}/items",
                         json={"items": [{"role": "user", "content": "x"}], "extra": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra"
        r = await c.put(f"/v1/conversations/{conv['id']}", json={})
        assert r.status_code == 405
    async with client_for(gw, theirs) as c:
        for r in (await c.get(f"/v1/conversations/{conv['id']}"),
                  await c.get(f"/v1/conversations/{conv['id']}/items"),
                  await c.delete(f"/v1/conversations/{conv['id']}"),
                  await c.post(f"/v1/conversations/{conv['id']}/items",
                               json={"items": [{"role": "user", "content": "x"}]})):
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "conversation_not_found"
        r = await c.post("/v1/responses", json={**TURN, "input": "x",
                                                "conversation": conv["id"]})
        assert r.status_code == 404
    async with client_for(gw, mine) as c:  # untouched by the other tenant
        r = await c.get(f"/v1/conversations/{conv['id']}/items")
        assert r.status_code == 200 and r.json()["data"] == []


async def test_a_gateway_that_keeps_no_responses_keeps_conversations(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    """`--response-retention 0`: conversations still work (they are the client's own
    objects); the turns in them are not stored as responses."""
    gw = gateway(engine, sqlite_store, counter, response_retention_s=0.0)
    async with client_for(gw, new_key(sqlite_store)) as c:
        conv = (await c.post("/v1/conversations", json={})).json()
        r = await c.post("/v1/responses", json={**TURN, "input": "hi",
                                                "conversation": conv["id"]})
        assert r.status_code == 200, r.text
        turn = r.json()
        assert turn["store"] is False and turn["conversation"] == {"id": conv["id"]}
        items = (await c.get(f"/v1/conversations/{conv['id']}/items")).json()["data"]
        assert [i["role"] for i in items] == ["assistant", "user"]
        assert (await c.get(f"/v1/responses/{turn['id']}")).status_code == 404
        r = await c.post("/v1/responses", json={**TURN, "input": "hi", "store": True,
                                                "conversation": conv["id"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_the_store_keeps_a_tenants_conversations_in_order(any_store: SQLStore) -> None:
    """SQLite and PostgreSQL: items in the order added, per conversation; another
    tenant finds nothing; deleting a conversation takes its items."""
    from sluice.gateway.store import StoredConversation

    conv = StoredConversation("conv_a", "t1", {"k": "v"}, 1.0)
    any_store.create_conversation(conv, [{"id": "m1"}, {"id": "m2"}])
    any_store.create_conversation(StoredConversation("conv_b", "t1"), [{"id": "x"}])
    assert any_store.get_conversation("conv_a", "t1") == conv
    assert any_store.get_conversation("conv_a", "t2") is None
    assert any_store.add_conversation_items("conv_a", "t1", [{"id": "m3"}, {"id": "m4"}])
    assert not any_store.add_conversation_items("conv_a", "t2", [{"id": "no"}])
    assert [i["id"] for i in any_store.conversation_items("conv_a", "t1") or []] == [
        "m1", "m2", "m3", "m4"]
    assert any_store.conversation_items("conv_a", "t2") is None
    assert any_store.delete_conversation_item("conv_a", "t1", "m2")
    assert not any_store.delete_conversation_item("conv_a", "t1", "m2")
    assert not any_store.delete_conversation_item("conv_a", "t2", "m1")
    updated = any_store.update_conversation("conv_a", "t1", {"k": "w"})
    assert updated is not None and updated.metadata == {"k": "w"}
    assert any_store.update_conversation("conv_a", "t2", {}) is None
    assert not any_store.delete_conversation("conv_a", "t2")
    assert any_store.delete_conversation("conv_a", "t1")
    assert any_store.conversation_items("conv_a", "t1") is None
    with any_store.engine.connect() as conn:
        left = conn.execute(any_store.items.select()).all()
    assert [row.item_id for row in left] == ["x"]  # conv_b's, untouched


@pytest.mark.services
async def test_two_gateway_replicas_share_the_state(engine: Any, counter: PromptTokenCounter,
                                                    pg_store: SQLStore) -> None:
    """Two gateways on one PostgreSQL database (each its own engine and connections, as
    replicas are): a turn answered by one is continued, listed and deleted through the
    other, by `previous_response_id` and by `conversation`."""
    prefix = pg_store.tenants.name.removesuffix("tenants")
    key = new_key(pg_store)
    replicas = [gateway(engine, SQLStore(PG_URL, table_prefix=prefix), counter)
                for _ in range(2)]
    try:
        async with client_for(replicas[0], key) as a, client_for(replicas[1], key) as b:
            first = (await a.post("/v1/responses", json={**TURN, "input": "I am Ada."})).json()
            second = await b.post("/v1/responses", json={
                **TURN, "input": "Who am I?", "previous_response_id": first["id"]})
            assert second.status_code == 200, second.text
            assert second.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]
            assert (await b.get(f"/v1/responses/{first['id']}")).json() == first
            conv = (await b.post("/v1/conversations", json={})).json()
            turn = await a.post("/v1/responses", json={**TURN, "input": "hi",
                                                        "conversation": conv["id"]})
            assert turn.status_code == 200, turn.text
            items = (await b.get(f"/v1/conversations/{conv['id']}/items")).json()["data"]
            assert len(items) == 2
            assert (await a.delete(f"/v1/responses/{first['id']}")).status_code == 200
            assert (await b.get(f"/v1/responses/{first['id']}")).status_code == 404
    finally:
        for gw in replicas:
            gw.state.store.close()
