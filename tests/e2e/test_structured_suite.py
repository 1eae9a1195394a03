"""Structured output and tools on the real default model, through `sluice serve`
(gateway -> router -> worker), with the openai SDK: 32 JSON schemas at temperature 0
and 1 (n=2, streamed), each output validated with `jsonschema`; regex and choice; a
forced tool call and its round trip."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from e2e.test_serve import serve


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 16}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": NAME}),
    _obj({"name": NAME, "age": AGE}),
    _obj({"city": NAME, "country": NAME, "population": {"type": "integer", "minimum": 0,
                                                        "maximum": 50_000_000}}),
    _obj({"ok": {"type": "boolean"}}),
    _obj({"colour": {"enum": ["red", "green", "blue"]}}),
    _obj({"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {"type": "integer",
                                                                     "minimum": 1,
                                                                     "maximum": 5}}),
    _obj({"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                "maximum": 100}, "minItems": 2,
                     "maxItems": 4}}),
    _obj({"person": _obj({"name": NAME, "age": AGE})}),
    _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),
    _obj({"people": {"type": "array", "items": _obj({"name": NAME}), "maxItems": 2}}),
    _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "n": AGE}),
    _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}}),
    _obj({"value": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}),
    _obj({"kind": {"const": "event"}, "title": NAME}),
    _obj({"title": NAME, "note": NAME}, required=["title"]),
    _obj({"temp": {"type": "integer", "minimum": -40, "maximum": 50},
          "unit": {"enum": ["C", "F"]}}),
    _obj({"rgb": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                             "maximum": 255}, "minItems": 3,
                  "maxItems": 3}}),
    _obj({"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0,
                                                  "maximum": 9}}}}),
    _obj({"book": _obj({"title": NAME, "year": {"type": "integer", "minimum": 1800,
                                                "maximum": 2030}}),
          "available": {"type": "boolean"}}),
    _obj({"status": {"enum": ["open", "closed"]}, "count": AGE, "flag": {"type": "boolean"}}),
    _obj({"first": NAME, "last": NAME, "email": {"type": "string",
                                                 "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}),
    _obj({"items": {"type": "array", "items": _obj({"sku": {"type": "string",
                                                            "pattern": "^[A-Z][0-9]{3}$"},
                                                    "qty": AGE}),
                    "minItems": 1, "maxItems": 2}}),
    _obj({"shape": {"anyOf": [_obj({"circle": AGE}), _obj({"square": AGE})]}}),
    _obj({"level": {"type": "integer", "minimum": 1, "maximum": 3}, "label": NAME}),
    _obj({"words": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2,
                    "maxItems": 5}}),
    _obj({"lat": {"type": "integer", "minimum": -90, "maximum": 90},
          "lon": {"type": "integer", "minimum": -180, "maximum": 180}}),
    _obj({"user": _obj({"id": AGE, "roles": {"type": "array", "items": {
        "enum": ["admin", "dev"]}, "maxItems": 2}})}),
    _obj({"empty": _obj({})}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
]
TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": _obj({"city": NAME, "unit": {"enum": ["C", "F"]}})}}]


def _fmt(schema: dict[str, Any], i: int) -> Any:
    return {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                   "strict": True}}


async def _check_schema(client: openai.AsyncOpenAI, model: str, i: int,
                        schema: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": f"Reply with JSON for this schema: "
                                            f"{json.dumps(schema)}"}]
    greedy = await client.chat.completions.create(
        model=model, messages=messages, response_format=_fmt(schema, i), temperature=0,
        max_tokens=200)
    texts = {0: greedy.choices[0].message.content or ""}
    assert greedy.choices[0].finish_reason == "stop", (i, texts[0])
    streamed: dict[int, str] = {}
    async for chunk in await client.chat.completions.create(
            model=model, messages=messages, response_format=_fmt(schema, i), temperature=1.0,
            seed=i, n=2, max_tokens=200, stream=True):
        for c in chunk.choices:
            streamed[1 + c.index] = streamed.get(1 + c.index, "") + (c.delta.content or "")
            assert c.finish_reason in (None, "stop"), (i, streamed)
    for text in [*texts.values(), *streamed.values()]:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.model
def test_structured_outputs_and_tools_through_serve(tmp_path: Path) -> None:
    with serve([], tmp_path, 180) as (url, key, _log):
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        model = client.models.list().data[0].id
        assert len(SCHEMAS) >= 30

        async def all_schemas() -> None:
            aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0,
                                         timeout=300)
            await asyncio.gather(*(_check_schema(aclient, model, i, s)
                                   for i, s in enumerate(SCHEMAS)))

        asyncio.run(all_schemas())

        for extra, pattern in [({"regex": "[0-9]{3}-[0-9]{4}"}, r"[0-9]{3}-[0-9]{4}"),
                               ({"choice": ["Paris", "Rome"]}, r"Paris|Rome")]:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Capital of France?"}],
                max_tokens=20, temperature=0, extra_body={"structured_outputs": extra})
            assert re.fullmatch(pattern, reply.choices[0].message.content or "")

        ask = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model=model, messages=ask, tools=TOOLS,
                                               tool_choice="required", temperature=0,
                                               max_tokens=100, parallel_tool_calls=False)
        call = (first.choices[0].message.tool_calls or [None])[0]
        assert call is not None and first.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments),
                            TOOLS[0]["function"]["parameters"])
        history = [*ask, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id,
                    "content": json.dumps({"temperature_c": 21, "sky": "clear"})}]
        final = client.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                               temperature=0, max_tokens=60)
        assert final.choices[0].message.content and final.usage.prompt_tokens > \
            first.usage.prompt_tokens
