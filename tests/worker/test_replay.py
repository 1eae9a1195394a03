"""A resumed stream's tool-call parsing and Anthropic events (worker/chat.py `_replay`,
`StreamTranslator.replay`): whatever token the first worker failed after, the client's
deltas from the first worker then the second add up to the uninterrupted stream's."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.protocol.anthropic import MessagesRequest, StreamTranslator
from sluice.protocol.openai import DeltaMessage
from sluice.worker.chat import _StreamedTools
from sluice.worker.tool_parsers import HermesToolParser

OUTPUT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
          ' "unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
          '{"zone": "CET"}}\n</tool_call>')
PIECES = [OUTPUT[i:i + 3] for i in range(0, len(OUTPUT), 3)]  # the "tokens"


def _deltas(tools: _StreamedTools, pieces: list[str], last: bool) -> list[DeltaMessage]:
    return [tools.feed(0, p, last and i == len(pieces) - 1) for i, p in enumerate(pieces)]


def _said(deltas: list[DeltaMessage]) -> tuple[str, dict[int, tuple[str, str]], int]:
    """(content, {call index: (name, arguments)}, call ids sent) of a client's deltas."""
    content, calls, ids = "", {}, 0
    for d in deltas:
        content += d.content or ""
        for call in d.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            fn = call.function
            calls[call.index] = (name + (fn.name or "" if fn else ""),
                                 args + (fn.arguments or "" if fn else ""))
            ids += call.id is not None
    return content, calls, ids


def _resumed(k: int) -> list[DeltaMessage]:
    """The client's deltas when the first worker failed after PIECES[:k]."""
    first = _deltas(_StreamedTools(HermesToolParser(), True), PIECES[:k], last=False)
    second = _StreamedTools(HermesToolParser(), True)
    second.feed(0, "".join(PIECES[:k]), finished=False)  # _replay: said by the first
    return first + _deltas(second, PIECES[k:], last=True)


def test_tool_calls_resume_at_every_token() -> None:
    whole = _said(_deltas(_StreamedTools(HermesToolParser(), True), PIECES, last=True))
    assert whole == ("Let me check. ", {0: ("get_weather", '{"city": "Paris", "unit": "c"}'),
                                        1: ("get_time", '{"zone": "CET"}')}, 2)
    for k in range(len(PIECES) + 1):
        assert _said(_resumed(k)) == whole, f"resumed after piece {k}"


def _events(translator: StreamTranslator, deltas: list[DeltaMessage]) -> list[Any]:
    events = []
    for i, d in enumerate(deltas):
        last = i == len(deltas) - 1
        chunk = {"choices": [{"delta": d.model_dump(), "finish_reason": "stop" if last else None}]}
        events += translator.feed(chunk)
    return events + translator.finish()


def _plain(events: list[Any]) -> list[Any]:
    """Events without what is random per run (message and tool-use ids)."""
    out = []
    for name, data in events:
        if name == "message_start":
            data = {**data, "message": {**data["message"], "id": "msg"}}
        if name == "content_block_start" and data["content_block"]["type"] == "tool_use":
            data = {**data, "content_block": {**data["content_block"], "id": "tool"}}
        out.append((name, data))
    return out


REQUEST = MessagesRequest(model="m", max_tokens=10, messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("k", range(0, len(PIECES), 4))
def test_anthropic_events_resume_where_the_first_worker_stopped(k: int) -> None:
    whole = _events(StreamTranslator(REQUEST),
                    _deltas(_StreamedTools(HermesToolParser(), True), PIECES, last=True))
    first = StreamTranslator(REQUEST)
    first_deltas = _deltas(_StreamedTools(HermesToolParser(), True), PIECES[:k], last=False)
    sent = [e for d in first_deltas for e in first.feed({"choices": [{"delta": d.model_dump()}]})]
    if not sent:
        sent = first._start()  # the first worker's message_start went out with the role chunk
    second_tools = _StreamedTools(HermesToolParser(), True)
    second = StreamTranslator(REQUEST)
    second.replay(second_tools.feed(0, "".join(PIECES[:k]), finished=False).model_dump())
    rest = _events(second, _deltas(second_tools, PIECES[k:], last=True))
    assert _plain(sent + rest) == _plain(whole)
    assert [n for n, _ in sent + rest].count("message_start") == 1


def test_token_ids_ride_on_the_chunks_last_event_or_a_ping() -> None:
    translator = StreamTranslator(REQUEST)
    said = translator.feed({"choices": [{"delta": {"content": "Hi"}, "token_ids": [5, 6]}]})
    assert said[-1][0] == "content_block_delta" and said[-1][1]["token_ids"] == [5, 6]
    held = translator.feed({"choices": [{"delta": {}, "token_ids": [7]}]})
    assert held == [("ping", {"type": "ping", "token_ids": [7]})]
    assert translator.feed({"choices": [{"delta": {}, "token_ids": None}]}) == []
