"""Anthropic tool use without an engine: tools, tool_choice and tool blocks translated to
OpenAI chat and back, streamed tool calls as Anthropic events, refusals naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.protocol import anthropic
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import ChatCompletionRequest, parse_request
from sluice.protocol.prompt import CHAT, MESSAGES, prompt_view

WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
OPENAI_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": WEATHER["input_schema"]}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "data"}]},
        {"type": "text", "text": "Summarise, "}, {"type": "text", "text": "please."}]},
]
OPENAI_HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
    {"role": "user", "content": "Summarise, please."},
]


def request(**kw: Any) -> anthropic.MessagesRequest:
    return parse_request(anthropic.MessagesRequest,
                         {"model": "m", "max_tokens": 9, "messages": HISTORY, **kw})


def test_tools_tool_blocks_and_history_become_openai_chat() -> None:
    body = anthropic.to_chat_body(request(tools=[WEATHER, {**WEATHER, "name": "x",
                                                           "description": None}]))
    assert body["messages"] == OPENAI_HISTORY
    assert body["tools"] == [OPENAI_WEATHER, {"type": "function", "function": {
        "name": "x", "parameters": WEATHER["input_schema"]}}]
    assert "tool_choice" not in body and "parallel_tool_calls" not in body
    chat = parse_request(ChatCompletionRequest, body)  # a valid chat request ...
    assert [t.model_dump(exclude_unset=True) for t in chat.tools or []] == body["tools"]
    # ... whose templated view is the Anthropic prompt view (one rule set)
    assert prompt_view(MESSAGES, {"messages": HISTORY, "tools": [WEATHER]}) == prompt_view(
        CHAT, {"messages": OPENAI_HISTORY, "tools": [OPENAI_WEATHER]})


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_weather"},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ({"type": "any", "disable_parallel_tool_use": True},
     {"tool_choice": "required", "parallel_tool_calls": False}),
    ({"type": "auto", "disable_parallel_tool_use": False}, {"tool_choice": "auto"}),
])
def test_tool_choice(choice: dict, expected: dict) -> None:
    body = anthropic.to_chat_body(request(tools=[WEATHER], tool_choice=choice))
    assert {k: body[k] for k in ("tool_choice", "parallel_tool_calls") if k in body} == expected
    parse_request(ChatCompletionRequest, body).effective_tool_choice()


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "auto", "name": "get_weather"}}, "tool_choice"),
    ({"tool_choice": {"type": "none", "disable_parallel_tool_use": True}}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools.0.name"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{**WEATHER, "input_examples": [{}]}]}, "tools.0.input_examples"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages.0.content"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "a"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}]}]}, "messages.0.content"),
])
def test_bad_tool_fields_are_named(extra: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        request(**extra)
    assert info.value.param == param, info.value.message


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": [{"type": "tool_result"}]}], "messages.0.content.0.tool_use_id"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [
        {"type": "image", "source": {}}]}]}], "messages.0.content.0.content"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                         "input": []}]}], "messages.0.content.0.input"),
    ([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}],
     "messages.0.content.0.id"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
     "messages.0.content"),
    ([{"role": "system", "content": "x"}], "messages.0.role"),
    ([[]], "messages.0.role"),
])
def test_the_raw_prompt_view_refuses_what_the_worker_refuses(messages: list, param: str) -> None:
    """The gateway and the router read raw bodies: malformed blocks are 400s, never 500s."""
    with pytest.raises(InvalidRequestError) as info:
        prompt_view(MESSAGES, {"messages": messages})
    assert info.value.param == param
    with pytest.raises(InvalidRequestError):
        parse_request(anthropic.MessagesRequest, {"model": "m", "max_tokens": 1,
                                                  "messages": messages})


@pytest.mark.parametrize("tools", [{"name": "f"}, [{"name": "f"}], [{"name": "f", "input_schema": 1}],
                                   [{"type": "bash_20250124", "name": "bash"}], [7]])
def test_bad_tools_in_the_raw_view(tools: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        prompt_view(MESSAGES, {"messages": HISTORY[:1], "tools": tools})
    assert (info.value.param or "").startswith("tools")


def test_openai_tools_reach_the_template_in_one_key_order() -> None:
    """The template writes tools as JSON: a client's key order must not change the prompt
    the gateway counts (the worker re-dumps the parsed tools)."""
    shuffled = {"function": {"parameters": WEATHER["input_schema"], "description": "Weather in a city.",
                             "name": "get_weather"}, "type": "function"}
    view = prompt_view(CHAT, {"messages": HISTORY[:1], "tools": [shuffled]})
    assert view.tools == [OPENAI_WEATHER]
    assert json.dumps(view.tools) == json.dumps([OPENAI_WEATHER])
    chat = parse_request(ChatCompletionRequest, {"messages": HISTORY[:1], "tools": [shuffled]})
    assert json.dumps([t.model_dump(exclude_unset=True) for t in chat.tools or []]) == \
        json.dumps(view.tools)


def chat_response(message: dict, finish: str) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 12}}


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tool_calls_become_tool_use_blocks() -> None:
    req = request(tools=[WEATHER])
    resp = anthropic.from_chat_response(chat_response(
        {"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls"), req)
    assert resp.content == [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                             "input": {"city": "Paris"}}]
    assert (resp.stop_reason, resp.stop_sequence) == ("tool_use", None)
    resp = anthropic.from_chat_response(chat_response(
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            CALL, {**CALL, "id": "call_2", "function": {"name": "f", "arguments": "{}"}}]},
        "tool_calls"), req)
    assert [b["type"] for b in resp.content] == ["text", "tool_use", "tool_use"]
    assert resp.content[0]["text"] == "Checking." and resp.content[2]["input"] == {}
    # a call cut off by max_tokens has no complete input
    cut = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}
    resp = anthropic.from_chat_response(chat_response(
        {"role": "assistant", "content": None, "tool_calls": [cut]}, "length"), req)
    assert resp.content[0]["input"] == {} and resp.stop_reason == "max_tokens"
    # no calls: the text block as before, even when empty
    resp = anthropic.from_chat_response(chat_response({"role": "assistant", "content": ""},
                                                      "stop"), req)
    assert resp.content == [{"type": "text", "text": ""}] and resp.stop_reason == "end_turn"


def delta_chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            "usage": {"prompt_tokens": 30, "completion_tokens": 3}}


def tool_delta(index: int, arguments: str, name: str | None = None) -> dict:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        call.update(id=f"call_{index}", type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def test_stream_of_text_then_two_tool_calls() -> None:
    tr = anthropic.StreamTranslator(request(tools=[WEATHER], stream=True))
    events = tr.feed(delta_chunk({"role": "assistant", "content": ""}))
    for delta in ({"content": "Let me "}, {"content": "look."},
                  tool_delta(0, "", "get_weather"), tool_delta(0, '{"city": '),
                  tool_delta(0, '"Paris"}'), tool_delta(1, "{}", "f")):
        events += tr.feed(delta_chunk(delta))
    events += tr.feed(delta_chunk({}, "tool_calls"))
    events += tr.finish()
    got = [(name, data.get("index"), data.get("content_block") or data.get("delta"))
           for name, data in events]
    assert got == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "Let me "}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "look."}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "tool_use", "id": "call_0", "name": "get_weather",
                                    "input": {}}),
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": '{"city": '}),
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": '"Paris"}'}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "tool_use", "id": "call_1", "name": "f",
                                    "input": {}}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": "{}"}),
        ("content_block_stop", 2, None),
        ("message_delta", None, {"stop_reason": "tool_use", "stop_sequence": None}),
        ("message_stop", None, None)]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 30


def test_stream_of_a_forced_call_opens_no_text_block() -> None:
    tr = anthropic.StreamTranslator(request(tools=[WEATHER], stream=True))
    events = tr.feed(delta_chunk({"role": "assistant", "content": ""}))
    events += tr.feed(delta_chunk(tool_delta(0, '{"city": "Rome"}', "get_weather"), "tool_calls"))
    events += tr.finish()
    assert [n for n, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[2][1]["index"] == 0 and events[2][1]["content_block"]["type"] == "tool_use"


def test_stream_with_no_output_has_one_empty_text_block() -> None:
    tr = anthropic.StreamTranslator(request(stream=True))
    events = tr.feed(delta_chunk({"role": "assistant", "content": ""}, "length")) + tr.finish()
    assert [(n, d.get("index")) for n, d in events] == [
        ("message_start", None), ("ping", None), ("content_block_start", 0),
        ("content_block_stop", 0), ("message_delta", None), ("message_stop", None)]
    assert events[4][1]["delta"]["stop_reason"] == "max_tokens"
