"""The prompt half of the Anthropic translation (protocol/anthropic.py): a Messages
request and a count_tokens request with the same prompt template the same chat prompt,
so `/v1/messages/count_tokens` counts what `/v1/messages` reports as input tokens."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.protocol import anthropic
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import parse_request

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "weather", "description": "the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
PROMPTS: list[dict[str, Any]] = [
    {"messages": ASK},
    {"messages": ASK, "system": "You are terse.", "tools": [WEATHER],
     "tool_choice": {"type": "any"}},
    {"messages": [*ASK, {"role": "assistant", "content": "The weather in"}]},  # a prefill
    {"messages": [*ASK, {"role": "assistant", "content": "  "}]},  # an empty one: no prefill
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_messages_and_count_tokens_share_one_prompt_body(prompt: dict[str, Any]) -> None:
    sent = parse_request(anthropic.MessagesRequest, {"model": "m", "max_tokens": 5, **prompt})
    counted = parse_request(anthropic.CountTokensRequest, {"model": "m", **prompt})
    body = anthropic.prompt_body(counted)
    assert anthropic.prompt_body(sent) == body
    chat = anthropic.to_chat_body(sent)
    assert {k: chat[k] for k in body} == body  # the Messages request templates the same
    prefill = prompt["messages"][-1]["role"] == "assistant" \
        and prompt["messages"][-1]["content"].strip()
    assert ("continue_final_message" in body) == bool(prefill)
    if prefill:
        assert body["add_generation_prompt"] is False and body["continue_final_message"] is True


def test_the_prompt_body_checks_the_conversation() -> None:
    counted = parse_request(anthropic.CountTokensRequest, {
        "model": "m", "messages": [{"role": "user", "content": ""}]})
    with pytest.raises(InvalidRequestError) as err:
        anthropic.prompt_body(counted)
    assert err.value.param == "messages.0.content"
