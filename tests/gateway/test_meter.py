"""ResponseMeter on its own: what it reads off OpenAI and Anthropic bodies and streams."""

from __future__ import annotations

import json
from typing import Any

from sluice.gateway.meter import ResponseMeter


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def tool_delta(piece: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": piece}]}}]}


def test_streamed_tool_calls_are_kept_as_text() -> None:
    """A stream of tool calls was metered as no text: its audit body was empty and, cut
    short, it was charged 0 completion tokens. The name and argument pieces count."""
    meter = ResponseMeter(streaming=True)
    meter.feed(sse(tool_delta({"name": "get_weather", "arguments": ""}),
                   tool_delta({"arguments": '{"city": '}), tool_delta({"arguments": '"Paris"}'})))
    assert meter.text == 'get_weather{"city": "Paris"}'
    claude = ResponseMeter(protocol="anthropic", streaming=True)
    claude.feed(sse(
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": '{"city": "Par'}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": 'is"}'}},
        {"type": "content_block_delta", "index": 1,
         "delta": {"type": "text_delta", "text": " done"}}))
    assert claude.text == 'get_weather{"city": "Paris"} done'


def test_json_tool_calls_are_kept_as_text() -> None:
    meter = ResponseMeter()
    meter.feed(json.dumps({"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "c", "type": "function",
         "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]}).encode())
    meter.finish()
    assert meter.text == 'f{"a": 1}' and meter.completion_tokens is None
    claude = ResponseMeter(protocol="anthropic")
    claude.feed(json.dumps({"content": [{"type": "text", "text": "ok "}, {
        "type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]}).encode())
    claude.finish()
    assert claude.text == 'ok f{"a": 1}'


def test_usage_null_is_taken_out_only_when_the_gateway_asked_for_usage() -> None:
    """OpenAI puts `"usage": null` on every chunk when include_usage is on; when the
    gateway added the option (the client did not ask) the client saw it on every chunk.
    Now it sees the chunks as without the option: no null usage, no usage-only chunk.
    Cut mid-event (the null's chunk split across feeds, CRLF endings) it is the same."""
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "h\u00e9"}}],
             "usage": None}
    last = {"id": "c", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}
    raw = (f"data: {json.dumps(chunk)}\r\n\r\n".encode() + sse(last) + b"data: [DONE]\n\n")
    meter = ResponseMeter(strip_usage_chunk=True, streaming=True)
    out = b"".join(meter.feed(raw[i:i + 7]) for i in range(0, len(raw), 7)) + meter.finish()
    events = [e for e in out.replace(b"\r\n", b"\n").split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == 2
    assert json.loads(events[0][6:]) == {k: v for k, v in chunk.items() if k != "usage"}
    assert out.startswith(b"data: ") and b"\r\n\r\n" in out
    assert (meter.prompt_tokens, meter.completion_tokens, meter.text) == (2, 1, "h\u00e9")
    asked = ResponseMeter(streaming=True)
    assert asked.feed(raw) + asked.finish() == raw  # the client's own option: as sent
