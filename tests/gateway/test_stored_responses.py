"""The Responses API's stored responses, kept by the gateway in front of a real sluice
worker (tiny random Llama, SmolLM2 tokenizer): `previous_response_id` continues a
conversation through a stateless worker, the stored-response routes, tenant isolation,
expiry, and a gateway that keeps none (gateway/responses.py)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, StoredResponse, UsageQuery
from sluice.gateway.tokens import PromptTokenCounter
from sluice.protocol.prompt import RESPONSES, prompt_view

from .conftest import client_for, make_state, new_key


def gateway_over_worker(engine: Any, store: SQLStore, counter: PromptTokenCounter,
                        **config: Any) -> GatewayMiddleware:
    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    state = make_state(store, count=counter)
    state = dataclasses.replace(state, config=dataclasses.replace(state.config, **config))
    return GatewayMiddleware(build_app(engine, WorkerConfig(served_model_names=("tiny",))),
                             state)


TURN = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}


def stream_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(e.split("\ndata: ", 1)[1]) for e in text.split("\n\n") if e]


async def test_a_conversation_continues_by_previous_response_id(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    gw = gateway_over_worker(engine, sqlite_store, counter)
    key = new_key(sqlite_store, tpm=100_000, rpm=1000)
    async with client_for(gw, key) as c:
        r = await c.post("/v1/responses", json={**TURN, "instructions": "Be brief.",
                                                "input": "My name is Ada."})
        assert r.status_code == 200, r.text
        first = r.json()
        assert first["store"] is True and first["previous_response_id"] is None

        # the second turn: the worker sees the first turn's input and output, then its
        # own (the instructions are not carried over, as in OpenAI's API)
        r = await c.post("/v1/responses", json={**TURN, "input": "What is my name?",
                                                "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        second = r.json()
        assert second["previous_response_id"] == first["id"] and second["store"] is True
        said = first["output"][0]["content"][0]["text"]
        whole = {"model": "tiny", "input": [
            {"role": "user", "content": "My name is Ada."},
            {"role": "assistant", "content": said},
            {"role": "user", "content": "What is my name?"}]}
        counted = counter.prompt_tokens("tiny", prompt_view(RESPONSES, whole))
        assert counted is not None
        assert second["usage"]["input_tokens"] == counted[0]  # the whole conversation
        assert r.headers["x-ratelimit-remaining-tokens"] is not None

        # a streamed third turn: every Response in it says so, and the final one is kept
        r = await c.post("/v1/responses", json={**TURN, "input": "And again?", "stream": True,
                                                "previous_response_id": second["id"]})
        assert r.status_code == 200, r.text
        events = stream_events(r.text)
        carried = [e["response"] for e in events if "response" in e]
        assert len(carried) >= 3  # created, in_progress, completed / incomplete
        assert all(x["store"] is True and x["previous_response_id"] == second["id"]
                   for x in carried)
        third = carried[-1]
        assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]

        r = await c.get(f"/v1/responses/{first['id']}")
        assert r.status_code == 200 and r.json() == first
        r = await c.get(f"/v1/responses/{third['id']}")
        assert r.status_code == 200 and r.json() == third

        # the items that produced the third answer: the whole conversation, newest first
        r = await c.get(f"/v1/responses/{third['id']}/input_items", params={"order": "asc"})
        assert r.status_code == 200, r.text
        listing = r.json()
        items = listing["data"]
        assert [(i["type"], i["role"]) for i in items] == [
            ("message", "user"), ("message", "assistant")] * 2 + [("message", "user")]
        assert [i["content"][0]["text"] for i in items[::2]] == [
            "My name is Ada.", "What is my name?", "And again?"]
        assert items[1] == first["output"][0] and items[3] == second["output"][0]
        assert listing["first_id"] == items[0]["id"] and listing["has_more"] is False
        r = await c.get(f"/v1/responses/{third['id']}/input_items")
        assert r.json()["data"] == items[::-1]  # OpenAI's default order
        r = await c.get(f"/v1/responses/{third['id']}/input_items",
                        params={"order": "asc", "limit": 2, "after": items[0]["id"]})
        page = r.json()
        assert page["data"] == items[1:3] and page["has_more"] is True
        r = await c.get(f"/v1/responses/{third['id']}/input_items", params={"limit": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "limit"

        # only background responses can be cancelled; unknown ids are 404s
        r = await c.post(f"/v1/responses/{first['id']}/cancel")
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
        r = await c.get("/v1/responses/resp_nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"

        # store: false answers as before and keeps nothing
        r = await c.post("/v1/responses", json={**TURN, "input": "x", "store": False})
        unkept = r.json()
        assert unkept["store"] is False
        assert (await c.get(f"/v1/responses/{unkept['id']}")).status_code == 404

        # deleting the middle of a conversation breaks its continuation, clearly
        r = await c.delete(f"/v1/responses/{second['id']}")
        assert r.json() == {"id": second["id"], "object": "response.deleted", "deleted": True}
        assert (await c.get(f"/v1/responses/{second['id']}")).status_code == 404
        assert (await c.delete(f"/v1/responses/{second['id']}")).status_code == 404
        r = await c.post("/v1/responses", json={**TURN, "input": "?",
                                                "previous_response_id": third["id"]})
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["param"] == "previous_response_id" and second["id"] in error["message"]
        assert "deleted or expired" in error["message"]
    records = sqlite_store.query_usage(UsageQuery())
    endpoints = {x.endpoint for x in records}
    assert {"/v1/responses", "/v1/responses/{response_id}",
            "/v1/responses/{response_id}/input_items",
            "/v1/responses/{response_id}/cancel"} == endpoints
    generated = [x for x in records if x.endpoint == "/v1/responses" and x.status == "ok"]
    assert [x.prompt_tokens for x in generated[:3]] == [
        first["usage"]["input_tokens"], second["usage"]["input_tokens"],
        third["usage"]["input_tokens"]]
    assert all(x.prompt_tokens == 0 for x in records if x.endpoint != "/v1/responses")


async def test_another_tenant_finds_no_response(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    gw = gateway_over_worker(engine, sqlite_store, counter)
    mine, theirs = new_key(sqlite_store, "acme"), new_key(sqlite_store, "other")
    async with client_for(gw, mine) as c:
        kept = (await c.post("/v1/responses", json={**TURN, "input": "secret"})).json()
    async with client_for(gw, theirs) as c:
        for r in (await c.get(f"/v1/responses/{kept['id']}"),
                  await c.get(f"/v1/responses/{kept['id']}/input_items"),
                  await c.delete(f"/v1/responses/{kept['id']}")):
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        r = await c.post("/v1/responses", json={**TURN, "input": "what was it?",
                                                "previous_response_id": kept["id"]})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "previous_response_not_found"
        r = await c.post("/v1/responses/input_tokens", json={
            "model": "tiny", "input": "x", "previous_response_id": kept["id"]})
        assert r.status_code == 404
    async with client_for(gw, mine) as c:  # still there for its own tenant
        assert (await c.get(f"/v1/responses/{kept['id']}")).status_code == 200
        r = await c.post("/v1/responses/input_tokens", json={
            "model": "tiny", "input": "what was it?", "previous_response_id": kept["id"]})
        assert r.status_code == 200, r.text
        again = await c.post("/v1/responses", json={**TURN, "input": "what was it?",
                                                    "previous_response_id": kept["id"]})
        assert r.json()["input_tokens"] == again.json()["usage"]["input_tokens"]


async def test_a_gateway_that_keeps_no_responses(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    """`--response-retention 0`: the worker's own answers stand (`store` false, its 404s),
    and `previous_response_id` is the gateway's 400 saying why."""
    gw = gateway_over_worker(engine, sqlite_store, counter, response_retention_s=0.0)
    key = new_key(sqlite_store)
    async with client_for(gw, key) as c:
        r = await c.post("/v1/responses", json={**TURN, "input": "x"})
        assert r.status_code == 200 and r.json()["store"] is False
        r404 = await c.get(f"/v1/responses/{r.json()['id']}")
        assert r404.status_code == 404 and "stores no responses" in r404.json()["error"]["message"]
        r = await c.post("/v1/responses", json={**TURN, "input": "x", "store": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "store"
        r = await c.post("/v1/responses", json={**TURN, "input": "x",
                                                "previous_response_id": "resp_1"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "previous_response_id"
        assert "--response-retention 0" in r.json()["error"]["message"]


async def test_bad_store_fields_are_400s(engine: Any, counter: PromptTokenCounter,
                                         sqlite_store: SQLStore) -> None:
    gw = gateway_over_worker(engine, sqlite_store, counter)
    async with client_for(gw, new_key(sqlite_store)) as c:
        for body, param in (({"store": "yes"}, "store"),
                            ({"previous_response_id": 7}, "previous_response_id"),
                            ({"previous_response_id": "resp_1", "input": 7}, "input")):
            r = await c.post("/v1/responses", json={**TURN, "input": "x", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = await c.get("/v1/responses/resp_1", params={"include": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include"


def test_the_store_keeps_responses_per_tenant_until_they_expire(any_store: SQLStore) -> None:
    now = time.time()
    kept = StoredResponse("resp_a", "t1", "k1", None, [{"type": "message", "id": "msg_1"}],
                          {"id": "resp_a", "output": []}, now, now + 60)
    any_store.save_response(kept)
    assert any_store.get_response("resp_a", "t1") == kept
    assert any_store.get_response("resp_a", "t2") is None
    assert not any_store.delete_response("resp_a", "t2")
    gone = StoredResponse("resp_b", "t1", "k1", "resp_a", [], {"id": "resp_b"}, now - 120,
                          now - 60)
    any_store.save_response(gone)
    assert any_store.get_response("resp_b", "t1") is None  # expired
    forever = dataclasses.replace(gone, id="resp_c", expires_at=None)
    any_store.save_response(forever)  # and the expired one is swept on a save
    assert any_store.get_response("resp_c", "t1") == forever
    assert any_store.delete_response("resp_a", "t1")
    assert any_store.get_response("resp_a", "t1") is None
    with any_store.engine.connect() as conn:
        rows = conn.execute(any_store.responses.select()).all()
    assert [row.id for row in rows] == ["resp_c"]


async def test_a_store_that_fails_is_a_503(engine: Any, counter: PromptTokenCounter,
                                           sqlite_store: SQLStore,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A database error reading a stored response is OpenAI's 503 saying so, not a bare
    500; a failed save is logged and the client keeps its answer."""
    import sqlalchemy as sa

    def down(*args: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("connection refused"))

    gw = gateway_over_worker(engine, sqlite_store, counter)
    async with client_for(gw, new_key(sqlite_store)) as c:
        monkeypatch.setattr(sqlite_store, "save_response", down)
        r = await c.post("/v1/responses", json={**TURN, "input": "x"})
        assert r.status_code == 200 and r.json()["store"] is True
        monkeypatch.setattr(sqlite_store, "get_response", down)
        for r in (await c.get("/v1/responses/resp_1"),
                  await c.post("/v1/responses", json={**TURN, "input": "x",
                                                      "previous_response_id": "resp_1"})):
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "response_store_unavailable"
            assert "Retry-After" in r.headers
