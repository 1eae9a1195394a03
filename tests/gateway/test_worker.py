"""The gateway in front of a real sluice worker (tiny random Llama, SmolLM2 tokenizer):
prompt tokens counted at admission equal the engine's own count, the class priority
(a header) is taken by the worker, usage from JSON and SSE (OpenAI and Anthropic) lands in the
ledger."""

from __future__ import annotations

import json
from typing import Any

from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.store import SQLStore, UsageQuery
from sluice.gateway.tokens import PromptTokenCounter

from .conftest import client_for, make_state, new_key


async def test_gateway_over_real_worker(engine: Any, counter: PromptTokenCounter,
                                        sqlite_store: SQLStore) -> None:
    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    worker = build_app(engine, WorkerConfig(served_model_names=("tiny",)))
    key = new_key(sqlite_store, tpm=10_000, rpm=100, priority_class="batch")
    gw = GatewayMiddleware(worker, make_state(sqlite_store, count=counter))
    chat = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to three, please."}]}
    async with client_for(gw, key) as c:
        r = await c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == counter("tiny", chat)  # admission count is exact
        assert r.headers["x-ratelimit-remaining-tokens"] == str(
            10_000 - usage["prompt_tokens"] - 6)  # reserved prompt + max_tokens
        r = await c.post("/v1/chat/completions", json={**chat, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"

        r = await c.post("/v1/chat/completions", json={**chat, "stream": True})
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert all(ch["choices"] for ch in chunks)  # gateway's usage chunk stripped

        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello world",
                                                  "max_tokens": 4, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        last = json.loads([e for e in r.text.split("\n\n") if e][-2][6:])
        assert last["usage"]["prompt_tokens"] == counter("tiny", {"prompt": "Hello world"})

        r = await c.post("/v1/messages", json={"model": "tiny", "max_tokens": 5,
                                               "messages": [{"role": "user", "content": "Hi"}]},
                         headers={"x-api-key": key, "Authorization": ""})
        assert r.status_code == 200, r.text
        anthropic_usage = r.json()["usage"]
    records = sqlite_store.query_usage(UsageQuery())
    assert [(x.endpoint, x.status) for x in records] == [
        ("/v1/chat/completions", "ok"), ("/v1/chat/completions", "rejected"),
        ("/v1/chat/completions", "ok"), ("/v1/completions", "ok"), ("/v1/messages", "ok")]
    assert (records[0].prompt_tokens, records[0].completion_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert records[2].prompt_tokens == usage["prompt_tokens"]
    assert records[2].completion_tokens == 6
    assert (records[4].prompt_tokens, records[4].completion_tokens) == (
        anthropic_usage["input_tokens"], anthropic_usage["output_tokens"])


async def test_responses_through_the_gateway_are_counted_reserved_and_recorded(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    """`/v1/responses`: its prompt counted by the Responses view, `max_output_tokens`
    reserved against TPM, usage read off the JSON body and off the stream's
    `response.completed` (or `.incomplete`) event, one ledger row each."""
    from sluice.protocol.prompt import RESPONSES, prompt_view
    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    worker = build_app(engine, WorkerConfig(served_model_names=("tiny",)))
    key = new_key(sqlite_store, tpm=10_000, rpm=100)
    gw = GatewayMiddleware(worker, make_state(sqlite_store, count=counter))
    body = {"model": "tiny", "instructions": "Be brief.", "input": "Count to three, please.",
            "max_output_tokens": 6, "temperature": 0}
    counted = counter.prompt_tokens("tiny", prompt_view(RESPONSES, body))
    assert counted is not None
    async with client_for(gw, key) as c:
        r = await c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()
        assert whole["usage"]["input_tokens"] == counted[0]  # admission's count is exact
        assert r.headers["x-ratelimit-remaining-tokens"] == str(10_000 - counted[0] - 6)
        r = await c.post("/v1/responses", json={**body, "stream": True})
        assert r.status_code == 200, r.text
        events = [json.loads(e.split("\ndata: ", 1)[1]) for e in r.text.split("\n\n") if e]
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        assert "[DONE]" not in r.text  # (the gateway added nothing to the stream)
        r = await c.post("/v1/responses", json={**body, "store": True})  # the gateway keeps
        assert r.status_code == 200 and r.json()["store"] is True  # it (test_stored_responses)
    records = sqlite_store.query_usage(UsageQuery())
    assert [(x.endpoint, x.status) for x in records] == [("/v1/responses", "ok")] * 3
    for record in records:
        assert (record.prompt_tokens, record.completion_tokens) == (
            whole["usage"]["input_tokens"], whole["usage"]["output_tokens"])


WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
    "additionalProperties": False}


async def test_tool_calls_pass_the_gateway_and_tool_schemas_count_for_tpm(
        engine: Any, counter: PromptTokenCounter, sqlite_store: SQLStore) -> None:
    """Anthropic and OpenAI tool calls and response_format pass through unchanged; the
    admission count (TPM) includes the tool schemas and equals the worker's own."""
    import jsonschema

    from sluice.worker.app import build_app
    from sluice.worker.config import WorkerConfig

    worker = build_app(engine, WorkerConfig(served_model_names=("tiny",)))
    gw = GatewayMiddleware(worker, make_state(sqlite_store, count=counter))
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    bodies: dict[str, tuple[str, dict[str, Any]]] = {
        "anthropic": ("/v1/messages", {
            "model": "tiny", "max_tokens": 64, "temperature": 0, "messages": ask,
            "tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
            "tool_choice": {"type": "tool", "name": "get_weather"}}),
        "openai": ("/v1/chat/completions", {
            "model": "tiny", "max_tokens": 64, "temperature": 0, "messages": ask,
            "tools": [{"type": "function", "function": {"name": "get_weather",
                                                        "parameters": WEATHER_SCHEMA}}],
            "tool_choice": "required"}),
        "response_format": ("/v1/chat/completions", {
            "model": "tiny", "max_tokens": 64, "temperature": 0, "messages": ask,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "weather", "schema": WEATHER_SCHEMA}}}),
    }
    for name, (path, body) in bodies.items():
        key = new_key(sqlite_store, tenant=name, tpm=10_000, rpm=100)
        async with client_for(gw, key) as c:
            r = await c.post(path, json=body)
        assert r.status_code == 200, (name, r.text)
        out = r.json()
        if name == "anthropic":
            [block] = out["content"]
            assert out["stop_reason"] == "tool_use" and block["type"] == "tool_use", out
            jsonschema.validate(block["input"], WEATHER_SCHEMA)
            prompt = out["usage"]["input_tokens"]
        else:
            message = out["choices"][0]["message"]
            payload = message["tool_calls"][0]["function"]["arguments"] \
                if name == "openai" else message["content"]
            jsonschema.validate(json.loads(payload), WEATHER_SCHEMA)
            prompt = out["usage"]["prompt_tokens"]
        assert prompt == counter("tiny", body), name  # the admission count is the worker's
        assert r.headers["x-ratelimit-remaining-tokens"] == str(10_000 - prompt - 64), name
    bare = counter("tiny", {k: v for k, v in bodies["anthropic"][1].items()
                            if k not in ("tools", "tool_choice")})
    schema_tokens = len(counter.tokenizer("tiny")[0].encode(
        json.dumps(WEATHER_SCHEMA), add_special_tokens=False))
    assert counter("tiny", bodies["anthropic"][1]) - bare >= schema_tokens
