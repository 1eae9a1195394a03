"""Structured output and tool calls through the worker's HTTP API with the openai SDK, on
the tiny random model: its text is noise, so whatever is valid here is the grammar's work."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

TOOLS: list[Any] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog"]
    age: int = Field(ge=0, le=30)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_pydantic_object(client: openai.OpenAI, temperature: float) -> None:
    resp = client.chat.completions.parse(model="tiny", messages=USER, response_format=Pet,
                                         temperature=temperature, max_tokens=80, seed=1, n=2)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert isinstance(choice.message.parsed, Pet) and choice.finish_reason == "stop"


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60,
                                         temperature=0.0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # free JSON may run past max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:
        assert (obj.choices[0].message.content or "").startswith("{")
    for body, check in [({"regex": "[0-9]{4}-[0-9]{2}"}, lambda t: len(t) == 7 and t[4] == "-"),
                        ({"choice": ["red", "green"]}, lambda t: t in ("red", "green"))]:
        resp = client.completions.create(model="tiny", prompt="Colour:", max_tokens=20,
                                         extra_body={"structured_outputs": body})
        assert check(resp.choices[0].text), resp.choices[0].text


def _call_args(call: Any) -> dict[str, Any]:
    name = call.function.name
    args = json.loads(call.function.arguments)
    schema = next(t["function"].get("parameters", {"type": "object"}) for t in TOOLS
                  if t["function"]["name"] == name)
    jsonschema.validate(args, schema)
    return {"name": name, "arguments": call.function.arguments}


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_and_stream_identically(client: openai.OpenAI,
                                                           tool_choice: Any) -> None:
    kw: Any = dict(model="tiny", messages=USER, tools=TOOLS, tool_choice=tool_choice,
                   temperature=0.0, max_tokens=120)
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [_call_args(c) for c in choice.message.tool_calls or []]
    assert calls and all(c["name"] == "get_weather" for c in calls if isinstance(tool_choice, dict))

    streamed: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's first piece: id, type, name, arguments ""
                    assert d.type == "function" and d.function.name and d.index not in streamed
                    streamed[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.function.name is None
                streamed[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [streamed[i] for i in sorted(streamed)] == calls


def test_tool_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                           tool_choice="required", parallel_tool_calls=False,
                                           temperature=0.0, max_tokens=120)
    calls = first.choices[0].message.tool_calls or []
    assert len(calls) == 1
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 21}'}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           tool_choice="none", temperature=0.0, max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.content
    # the tool result reached the prompt: it is longer than the same turn without it
    shorter = client.chat.completions.create(model="tiny", messages=history[:-1] + [
        {"role": "tool", "tool_call_id": calls[0].id, "content": "{}"}], tool_choice="none",
        tools=TOOLS, temperature=0.0, max_tokens=1)
    assert final.usage.prompt_tokens > shorter.usage.prompt_tokens


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_are_parsed_and_parallel_false_keeps_one(client: openai.OpenAI,
                                                           parallel: bool, stream: bool) -> None:
    """Under `auto` nothing is forced; a grammar makes the model write two calls, which
    the parser reads back (only the first with `parallel_tool_calls: false`)."""
    call = '"<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {}}\\n</tool_call>"'
    kw: Any = dict(model="tiny", messages=USER, tools=TOOLS, parallel_tool_calls=parallel,
                   max_tokens=300, extra_body={"structured_outputs": {
                       "grammar": f'root ::= "Checking." {call} "\\n" {call}'}})
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        names = [c.function.name for c in choice.message.tool_calls or []]
        content, finish = choice.message.content, choice.finish_reason
    else:
        names, content, finish = [], "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                content += c.delta.content or ""
                names += [d.function.name for d in c.delta.tool_calls or [] if d.function.name]
    assert names == ["get_time"] * (2 if parallel else 1)
    assert content == "Checking." and finish == "tool_calls"


def test_a_grammar_that_breaks_mid_output_is_an_error_not_an_answer(
        client: openai.OpenAI) -> None:
    """Found by a new-user pass: `a{1000000}` (guidance, the default backend for a regex)
    was a 200 with empty text and finish_reason stop; its lexer refuses the first token.
    Whole: a 400 naming the constraint; streamed: the stream ends with an error event."""
    body: dict[str, Any] = dict(model="tiny", messages=USER, max_tokens=8,
                                extra_body={"structured_outputs": {"regex": "a{1000000}"}})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.body["param"] == "structured_outputs"  # type: ignore[index]
    with pytest.raises(openai.APIError) as streamed:
        for _ in client.chat.completions.create(stream=True, **body):
            pass
    assert "could not follow this constraint" in streamed.value.message
    ok = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
    assert ok.choices[0].finish_reason == "length"  # and the worker goes on


def test_response_format_structural_tag_in_both_of_vllms_forms(client: openai.OpenAI) -> None:
    """vLLM takes response_format {"type": "structural_tag"} with xgrammar's `format`, or
    the legacy `structures` + `triggers`; the worker refused the type (400 naming
    response_format.type). The legacy form is xgrammar's conversion: free text until a
    trigger, then one of the tags."""
    fmt = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "id="}, {"type": "regex", "pattern": "[0-9]{3}"}]}}
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20,
                                          response_format=fmt)
    text = resp.choices[0].message.content or ""
    assert resp.choices[0].finish_reason == "stop" and len(text) == 6 and text[:3] == "id=", text
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    legacy = {"type": "structural_tag", "triggers": ["<f"],
              "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}]}
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40,
                                          temperature=0.0, response_format=legacy)
    text = resp.choices[0].message.content or ""
    for call in text.split("<f>")[1:]:  # every tag the model opened holds the schema's JSON
        if "</f>" in call:
            assert json.loads(call[:call.index("</f>")])["k"] in (1, 2), text
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as info:  # as response_format's json_schema
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, response_format={
            "type": "structural_tag", "triggers": ["<f"],
            "structures": [{"begin": "<f>", "schema": unique, "end": "</f>"}]})
    assert info.value.body["param"] == "response_format"
    for bad in ({"type": "structural_tag"}, {"type": "structural_tag", "structures": []},
                {"type": "json_schema", "format": fmt["format"]},
                {"type": "structural_tag", "format": fmt["format"], "triggers": ["<"]}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                           response_format=bad)
        assert info.value.body["param"] == "response_format", bad
