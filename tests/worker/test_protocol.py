"""Wire types without an engine: parsing, refusal of unsupported fields, Anthropic translation."""

from __future__ import annotations

import pytest

from sluice.protocol import anthropic
from sluice.protocol.errors import InvalidRequestError, SluiceError
from sluice.protocol.openai import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
    reject_unsupported,
)

USER = [{"role": "user", "content": "hi"}]


def test_chat_request_accepts_openai_and_vllm_fields() -> None:
    req = parse_request(ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "system", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]},
                                   *USER],
        "max_completion_tokens": 5, "max_tokens": 9, "top_k": 3, "priority": -1, "n": 2,
        "stop": "x", "logprobs": True, "top_logprobs": 2, "ignore_eos": True, "min_tokens": 1,
        "stream_options": {"include_usage": True}, "user": "u", "seed": 7})
    assert req.messages[0].as_template_dict() == {"role": "system", "content": "ab"}
    assert req.requested_max_tokens() == 5
    assert req.stop_list() == ["x"]
    assert req.num_logprobs() == 2
    assert req.include_usage and not req.continuous_usage


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": USER, "bogus": 1}, "bogus"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": USER, "n": 0}, "n"),
])
def test_chat_request_errors_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, body)
    assert info.value.param == param
    assert info.value.status_code == 400


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{}]), ("function_call", "auto"), ("web_search_options", {}),
    ("audio", {"voice": "x"}),
    ("modalities", ["text", "audio"]),
])
def test_unsupported_chat_fields_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        reject_unsupported({"messages": USER, field: value}, UNSUPPORTED_CHAT)
    assert info.value.param == field
    assert "not supported" in info.value.message


def test_harmless_values_of_unsupported_fields_pass() -> None:
    body = {"messages": USER, "metadata": {}, "functions": [], "function_call": "none"}
    reject_unsupported(body, UNSUPPORTED_CHAT)
    with pytest.raises(InvalidRequestError, match="suffix"):
        reject_unsupported({"prompt": "a", "suffix": "b"}, UNSUPPORTED_COMPLETION)


def test_completion_prompt_forms() -> None:
    def prompts(p: object) -> list:
        return parse_request(CompletionRequest, {"prompt": p}).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(InvalidRequestError):
        prompts([])


def test_anthropic_to_openai_body() -> None:
    req = parse_request(anthropic.MessagesRequest, {
        "model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "be brief"}],
        "messages": USER, "stop_sequences": ["END"], "temperature": 0.0, "top_k": 2,
        "stream": True, "metadata": {"user_id": "u1"}})
    body = anthropic.to_chat_body(req)
    assert body["messages"] == [{"role": "system", "content": "be brief"}, *USER]
    assert body["max_tokens"] == 7 and body["stop"] == ["END"] and body["top_k"] == 2
    assert body["user"] == "u1" and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    parse_request(ChatCompletionRequest, body)  # the translation is a valid chat request


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": USER}, "max_tokens"),
    ({"model": "m", "max_tokens": 1, "messages": USER, "temperature": 1.5}, "temperature"),
    ({"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]},
     "messages.0.role"),
    ({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
])
def test_anthropic_request_errors(body: dict, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(anthropic.MessagesRequest, body)
    assert info.value.param == param


def test_anthropic_refuses_what_it_does_not_implement() -> None:
    with pytest.raises(InvalidRequestError) as info:
        anthropic.reject_unsupported({"container": "c_1"})
    assert info.value.param == "container"
    anthropic.reject_unsupported({"tools": [{"name": "x"}], "tool_choice": {"type": "auto"}})


@pytest.mark.parametrize(("thinking", "max_tokens", "named"), [
    ({"type": "enabled", "budget_tokens": 9}, 4096, "budget_tokens"),
    ({"type": "enabled"}, 4096, "budget_tokens"),
    ({"type": "disabled", "budget_tokens": 2048}, 4096, "budget_tokens"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "max_tokens"),
    ({"type": "adaptive"}, 4096, "thinking"),
])
def test_anthropic_thinking_is_checked_as_anthropic_checks_it(
        thinking: dict, max_tokens: int, named: str) -> None:
    body = {"model": "m", "max_tokens": max_tokens, "thinking": thinking,
            "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(InvalidRequestError) as info:
        parse_request(anthropic.MessagesRequest, body)
    assert named in str(info.value) or info.value.param == named
    ok = parse_request(anthropic.MessagesRequest, {
        **body, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert ok.thinks and "thinking" not in anthropic.to_chat_body(ok)


@pytest.mark.parametrize(("finish", "matched", "expected"), [
    ("length", None, ("max_tokens", None)),
    ("stop", None, ("end_turn", None)),
    ("stop", 2, ("end_turn", None)),
    ("stop", "END", ("stop_sequence", "END")),
    (None, None, (None, None)),
])
def test_stop_reason_mapping(finish: str | None, matched: object, expected: tuple) -> None:
    assert anthropic.stop_reason(finish, matched, ["END"]) == expected


def test_stream_translator_event_order_and_usage() -> None:
    req = parse_request(anthropic.MessagesRequest,
                        {"model": "m", "max_tokens": 5, "messages": USER,
                         "stop_sequences": ["."]})
    tr = anthropic.StreamTranslator(req)
    usage = {"prompt_tokens": 9, "completion_tokens": 0}
    events = tr.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                      "usage": usage})
    events += tr.feed({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop",
                                    "stop_reason": "."}],
                       "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
    events += tr.finish()
    names = [name for name, _ in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 9
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[5][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "."}
    assert events[5][1]["usage"] == {"output_tokens": 2}
    assert anthropic.sse(events[-1]) == 'event: message_stop\ndata: {"type": "message_stop"}\n\n'


def test_anthropic_error_shape() -> None:
    body = anthropic.error_body(InvalidRequestError("bad", param="x"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "x: bad"}}  # the field leads
    named = anthropic.error_body(InvalidRequestError("'x' is bad", param="x"))
    assert named["error"]["message"] == "'x' is bad"  # already named: left alone
    assert anthropic.error_body(SluiceError("boom"))["error"]["type"] == "api_error"


def test_completion_top_logprobs_hold_the_sampled_token_first() -> None:
    """Up to logprobs + 1 entries, as OpenAI documents and vLLM answers: the sampled token
    (first, also when it is not among the likeliest), then the `logprobs` likeliest."""
    from sluice.worker.logprobs import completion_logprobs

    class FakeTokenizer:  # token i is the i-th letter
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(96 + i) for i in ids)

    entries = [{5: -3.0, 1: -0.5, 2: -1.0}, {1: -0.5, 2: -1.0}]  # token 5 sampled, then 1
    out = completion_logprobs(FakeTokenizer(), [5, 1], entries, 2, 0)
    assert out.top_logprobs == [{"e": -3.0, "a": -0.5, "b": -1.0}, {"a": -0.5, "b": -1.0}]
    assert [list(t) for t in out.top_logprobs] == [["e", "a", "b"], ["a", "b"]]
    out = completion_logprobs(FakeTokenizer(), [5], entries[:1], 0, 0)
    assert out.top_logprobs == [{"e": -3.0}]


def test_continue_final_cuts_after_the_final_message() -> None:
    from sluice.protocol.prompt import MESSAGES, continue_final, prompt_view

    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe answer is<|im_end|>\n"
    assert continue_final(rendered, "The answer is").endswith("assistant\nThe answer is")
    assert continue_final(rendered, " The answer is  ").endswith("assistant\nThe answer is")
    with pytest.raises(InvalidRequestError):
        continue_final(rendered, "not there")
    body = {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]}
    assert prompt_view(MESSAGES, body).continue_final  # an Anthropic prefill
    body["messages"][1]["content"] = ""
    assert not prompt_view(MESSAGES, body).continue_final  # an empty one asks for nothing
    translated = anthropic.to_chat_body(anthropic.MessagesRequest.model_validate({
        **body, "messages": [body["messages"][0], {"role": "assistant", "content": "So"}]}))
    assert translated["continue_final_message"] and not translated["add_generation_prompt"]


@pytest.mark.parametrize("api", ["anthropic", "responses"])
async def test_a_translated_stream_that_breaks_ends_with_its_api_s_error_event(api: str) -> None:
    """`translated_sse`: chunks that fail mid-stream (the engine core died, say) end the
    stream with the API's own error event: Anthropic's `error`, the Responses API's
    `response.failed` carrying the error."""
    import json
    from collections.abc import AsyncIterator

    from pydantic import BaseModel

    from sluice.protocol import responses
    from sluice.protocol.openai import ChatCompletionChunk
    from sluice.worker.app import translated_sse

    async def chunks() -> AsyncIterator[BaseModel]:
        yield ChatCompletionChunk.model_validate({
            "id": "c", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"content": "Hel"}}]})
        raise SluiceError("engine core died")

    if api == "anthropic":
        req = anthropic.MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 5, "messages": USER})
        frames = [f async for f in translated_sse(chunks(), anthropic.StreamTranslator(req),
                                                  anthropic.sse)]
        assert frames[-1].startswith("event: error\n")
        assert "engine core died" in frames[-1]
        assert any("Hel" in f for f in frames)
        return
    rreq = responses.ResponsesRequest.model_validate({"model": "m", "input": "hi"})
    frames = [f async for f in translated_sse(chunks(), responses.StreamTranslator(rreq),
                                              responses.sse)]
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["message"] == "engine core died"
    [item] = events[-1]["response"]["output"]  # the message it was saying, as the API has it
    assert item["type"] == "message" and set(item) == {"type", "id", "status", "role", "content"}
    assert "Hel" in "".join(e.get("delta", "") for e in events)
