"""The Responses API's translation to chat and back (protocol/responses.py), on plain data."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.protocol import responses
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import parse_request, reject_unsupported
from sluice.protocol.prompt import RESPONSES, prompt_view

WEATHER = {"type": "function", "name": "weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**body: Any) -> responses.ResponsesRequest:
    return responses.ResponsesRequest.model_validate({"model": "m", **body})


def test_a_string_input_and_instructions_are_a_system_and_a_user_message() -> None:
    assert responses.chat_prompt({"input": "Hi", "instructions": "Be brief."}) == {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}]}
    assert responses.chat_prompt({"input": "Hi", "instructions": ""}) == {
        "messages": [{"role": "user", "content": "Hi"}]}


def test_items_become_turns_with_calls_and_their_outputs() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in "},
                     {"type": "input_text", "text": "Paris?"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "weather",
         "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "rain"}]},
    ]
    prompt = responses.chat_prompt({"input": items, "tools": [WEATHER]})
    assert prompt["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    assert prompt["tools"] == [{"type": "function", "function": {
        "name": "weather", "description": "Weather of a city",
        "parameters": WEATHER["parameters"]}}]
    # a call with no assistant message before it opens one without content
    lone = responses.chat_prompt({"input": [items[3]]})["messages"]
    assert lone == [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}]


def test_the_prompt_view_names_a_bad_field_as_the_responses_client_wrote_it() -> None:
    """The gateway refuses by the view: a call's arguments that are no JSON text are the
    chat view's `messages.0.tool_calls...`, which a Responses client never wrote."""
    with pytest.raises(InvalidRequestError) as err:
        prompt_view(RESPONSES, {"input": [{"type": "function_call", "call_id": "c",
                                           "name": "f", "arguments": "{not json"}]})
    assert err.value.param == "input"


def test_the_prompt_view_is_the_chat_view_of_the_translation() -> None:
    body = {"model": "m", "instructions": "Be brief.", "input": "Hi", "tools": [WEATHER]}
    view = prompt_view(RESPONSES, body)
    assert view.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]
    assert view.tools is not None and view.tools[0]["function"]["name"] == "weather"
    assert view.generation_prompt and not view.continue_final


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "computer_call_output", "output": {}}]}, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [["x"]]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": {"text": "x"}}]}, "input.0.content"),
    ({"input": ["x"]}, "input.0"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input.0.call_id"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
])
def test_what_cannot_be_translated_is_a_400_naming_the_responses_field(
        body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        responses.chat_prompt(body)
    assert err.value.param == param


@pytest.mark.parametrize(("field", "value"), [
    ("previous_response_id", "resp_1"), ("background", True), ("conversation", "conv_1"),
    ("include", ["reasoning.encrypted_content"]), ("reasoning", {"effort": "high"}),
    ("truncation", "auto"), ("top_logprobs", 2), ("top_logprobs", False)])
def test_unsupported_parameters_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as err:
        reject_unsupported({"model": "m", "input": "x", field: value}, responses.UNSUPPORTED)
    assert err.value.param == field


def test_store_true_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequestError) as err:
        parse_request(responses.ResponsesRequest, {"model": "m", "input": "x", "store": True})
    assert err.value.param == "store" and "keeps no responses" in err.value.message


def test_parameters_left_at_what_asks_for_nothing_pass() -> None:
    body = {"model": "m", "input": "x", "store": False, "truncation": "disabled",
            "include": [], "background": False, "previous_response_id": None}
    assert reject_unsupported(body, responses.UNSUPPORTED) == {"model": "m", "input": "x",
                                                              "store": False}


def test_the_chat_request_carries_the_sampling_fields_and_the_format() -> None:
    req = request(input="x", max_output_tokens=7, temperature=0, top_p=0.5,
                  tool_choice={"type": "function", "name": "weather"}, tools=[WEATHER],
                  parallel_tool_calls=False, stream=True, priority=3,
                  text={"format": {"type": "json_schema", "name": "city",
                                   "schema": {"type": "object"}, "strict": True}})
    chat = responses.to_chat_body(req, req.model_dump(by_alias=True, exclude_none=True))
    assert chat["max_tokens"] == 7 and chat["temperature"] == 0 and chat["top_p"] == 0.5
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is False and chat["priority"] == 3
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "city", "schema": {"type": "object"}, "strict": True}}
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_a_chat_completion_becomes_a_response_with_its_items_and_usage() -> None:
    req = request(input="x", max_output_tokens=5)
    chat = {"created": 7, "choices": [{"finish_reason": "length", "message": {
        "content": "Hello", "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Oslo"}'}}]}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}}
    resp = responses.from_chat_response(chat, req)
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    message, call = resp["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Hello"
    assert (call["type"], call["call_id"], call["name"], call["arguments"]) == (
        "function_call", "call_9", "weather", '{"city": "Oslo"}')
    assert resp["usage"]["input_tokens"] == 11 and resp["usage"]["output_tokens"] == 5
    assert resp["usage"]["total_tokens"] == 16 and resp["store"] is False


def chunk(content: str | None = None, calls: list[dict[str, Any]] | None = None,
          finish: str | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if content is not None:
        delta["content"] = content
    if calls is not None:
        delta["tool_calls"] = calls
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"choices": choices, "usage": usage}


def test_a_stream_is_openai_s_event_sequence_numbered_in_order() -> None:
    t = responses.StreamTranslator(request(input="x"))
    events = t.start()
    events += t.feed(chunk(""))
    events += t.feed(chunk("Hel"))
    events += t.feed(chunk("lo"))
    events += t.feed(chunk(calls=[{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "weather", "arguments": '{"ci'}}]))
    events += t.feed(chunk(calls=[{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}],
                           finish="tool_calls"))
    events += t.feed(chunk(usage={"prompt_tokens": 4, "completion_tokens": 9}))
    events += t.finish()
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[6]["text"] == "Hello"
    assert events[12]["arguments"] == '{"city": "Rome"}'
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][1]["arguments"] == '{"city": "Rome"}'
    assert final["usage"]["input_tokens"] == 4 and final["usage"]["output_tokens"] == 9
    assert all(e["output_index"] == 1 for e in events[9:14])
    json.dumps(events)  # plain data throughout


def test_thinking_is_a_reasoning_item_and_one_sent_back_is_left_out() -> None:
    """A worker with a reasoning parser: the chat message's `reasoning` becomes a
    reasoning item before the message (whole and streamed: `reasoning_text` deltas, the
    item closed when the answer begins); an input reasoning item (the Agents SDK sends
    the last turn's output back) adds nothing to the prompt."""
    req = request(input="x")
    chat = {"created": 7, "choices": [{"finish_reason": "stop", "message": {
        "content": "4", "reasoning": "2+2 is 4."}}], "usage": {"prompt_tokens": 3,
                                                             "completion_tokens": 6}}
    thought, message = responses.from_chat_response(chat, req)["output"]
    assert thought["type"] == "reasoning" and thought["id"].startswith("rs_")
    assert thought["content"] == [{"type": "reasoning_text", "text": "2+2 is 4."}]
    assert thought["summary"] == [] and message["content"][0]["text"] == "4"
    t = responses.StreamTranslator(req)
    events = t.start()
    for delta in ({"reasoning": "2+2 "}, {"reasoning": "is 4."}, {"content": "4"}):
        events += t.feed({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    events += t.finish()
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[5]["text"] == "2+2 is 4." and events[6]["item"]["content"][0]["text"] \
        == "2+2 is 4."
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["reasoning", "message"]
    only = responses.StreamTranslator(req)  # all thinking, cut: an empty message follows
    done = only.start() + only.feed({"choices": [{"index": 0, "delta": {"reasoning": "hm"},
                                                  "finish_reason": "length"}]}) + only.finish()
    assert [i["type"] for i in done[-1]["response"]["output"]] == ["reasoning", "message"]
    sent_back = {"input": [{"role": "user", "content": "x"}, {
        "type": "reasoning", "id": "rs_1", "summary": [],
        "content": [{"type": "reasoning_text", "text": "2+2 is 4."}]},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]}
    assert prompt_view(RESPONSES, sent_back).messages == [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}]


def test_a_stream_that_says_nothing_has_one_empty_message_and_a_cut_one_is_incomplete() -> None:
    t = responses.StreamTranslator(request(input="x"))
    events = t.start() + t.feed(chunk(finish="length")) + t.finish()
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.parametrize(("chat", "param"), [
    ("max_tokens", "max_output_tokens"), ("response_format", "text.format"),
    ("tools.0.function.parameters", "tools.0.parameters"), ("messages.2.content", "input"),
    ("temperature", "temperature")])
def test_chat_parameter_names_are_given_back_as_the_client_wrote_them(chat: str,
                                                                      param: str) -> None:
    assert responses.responses_param(chat) == param
