"""Reads usage off a response as it passes, without holding the stream back.

A `ResponseMeter` sees every body chunk the upstream sends. JSON bodies are kept
(bounded) and parsed at the end; Server-Sent Events are cut at event boundaries and
each `data:` payload is parsed on the way through:

    OpenAI      any chunk with a non-null `usage` (with `stream_options.include_usage`
                the last chunk: `"choices": []`); content from `choices[].delta.content`
                or `choices[].text`, and tool calls' names and argument pieces from
                `choices[].delta.tool_calls[].function`
    Anthropic   `message_start.message.usage.input_tokens`, `message_delta.usage
                .output_tokens` (cumulative; `message_start`'s own output_tokens, 0 or
                1 before anything streamed, is not read, so a stream cut before its
                `message_delta` is counted from its text); content from
                `content_block_delta` (its `text`, or a tool call's `partial_json`)
                and a `tool_use` block's name
    Responses   the `usage` of the Response (`input_tokens`, `output_tokens`): the JSON
                body's, the last event's (`response.completed`, `.incomplete` or
                `.failed`); content from `response.output_text.delta` and
                `response.function_call_arguments.delta`, a function call's name from
                its `response.output_item.added`

`ended` says that a stream's last event (`data: [DONE]`, Anthropic's `message_stop`, the
Responses API's `response.completed`) is in what `feed` returned, so the gateway
settles before the client has it.

The first `model` a response names (the JSON body's, the first chunk's, Anthropic's
`message_start.message.model`) is `served_model`: the model that really answered (an
adapter, or a cascade's small or large model, router/cascade.py), which the ledger
records and prices.

On the Responses API the meter also keeps the last Response object that ended the answer
(`response`: the JSON body's, a stream's `response.completed` / `.incomplete` /
`.failed`), which the gateway stores, and sets `patch`'s fields on every Response
object it passes on (gateway/responses.py: `"store": true`, `previous_response_id`); a
JSON body is then held until its end and re-encoded, an event that carries a Response
re-encoded.

When the gateway itself asked for `include_usage` (the client did not), the meter drops
that usage-only chunk, and takes the `"usage": null` an upstream that follows OpenAI
puts on every other chunk then out of them (such a chunk is re-encoded), so the client
sees the stream it would have seen without the option. The accumulated
content lets an aborted stream be charged for the tokens it produced so far.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_EVENT_END = re.compile(rb"\r?\n\r?\n")


@dataclass
class ResponseMeter:
    protocol: str = "openai"  # openai | anthropic | responses
    strip_usage_chunk: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    streaming: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    served_model: str | None = None
    ended: bool = False  # the stream's last event went by: `data: [DONE]`, `message_stop`
    patch: dict[str, Any] | None = None  # set on each Response object passed on
    response: dict[str, Any] | None = None  # the Response that ended the answer
    text_parts: list[str] = field(default_factory=list)
    _buffer: bytearray = field(default_factory=bytearray)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def body(self) -> bytes:
        return bytes(self._buffer)

    def feed(self, chunk: bytes) -> bytes:
        """Take upstream bytes; return the bytes to forward now."""
        if not self.streaming:
            if self.patch is not None:  # held: re-encoded whole by `finish`
                self._buffer += chunk
                return b""
            if len(self._buffer) + len(chunk) <= self.max_body_bytes:
                self._buffer += chunk
            return chunk
        self._buffer += chunk
        out = bytearray()
        while (match := _EVENT_END.search(self._buffer)) is not None:
            event = bytes(self._buffer[: match.end()])
            del self._buffer[: match.end()]
            out += self._on_event(event)
        return bytes(out)

    def finish(self) -> bytes:
        """End of body: parse a JSON body, or return an unterminated trailing event."""
        if not self.streaming:
            obj = self._on_json(self._buffer)
            if self.patch is None:
                return b""
            if obj is not self.response or self.response is None:  # an error body
                return bytes(self._buffer)
            self.response.update(self.patch)
            return json.dumps(self.response).encode()
        rest = bytes(self._buffer)
        self._buffer.clear()
        return self._on_event(rest) if rest.strip() else rest

    # -- parsing -----------------------------------------------------------------------

    def _on_json(self, raw: bytes | bytearray) -> Any:
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if isinstance(obj, dict):
            self._take_model(obj.get("model"))
            self._take_usage(obj.get("usage"))
            self._take_text(obj)
            if self.protocol == "responses" and obj.get("object") == "response":
                self.response = obj
        return obj

    def _on_event(self, event: bytes) -> bytes:
        """Parse one SSE event; the bytes of it the client gets (b"": none)."""
        lines = event.splitlines(keepends=True)
        changed = False
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.ended = True
                continue
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if not self._on_chunk(obj):
                return b""
            if self._rewrite(obj):
                end = line[len(line.rstrip(b"\r\n")):]
                lines[i] = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + end
                changed = True
        return b"".join(lines) if changed else event

    def _rewrite(self, obj: dict[str, Any]) -> bool:
        """Change an event's object for the client; whether it changed (re-encoded)."""
        if self.strip_usage_chunk and "usage" in obj and obj["usage"] is None:
            del obj["usage"]  # OpenAI's null on every chunk, there only for the option
            return True
        response = obj.get("response")
        if self.patch and isinstance(response, dict):
            response.update(self.patch)
            return True
        return False

    def _on_chunk(self, obj: dict[str, Any]) -> bool:
        if self.protocol == "anthropic":
            self._on_anthropic_event(obj)
            return True
        if self.protocol == "responses":
            self._on_responses_event(obj)
            return True
        usage = obj.get("usage")
        self._take_model(obj.get("model"))
        self._take_usage(usage)
        self._take_text(obj)
        return not (self.strip_usage_chunk and usage and not obj.get("choices"))

    def _on_anthropic_event(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "message_start":  # its output_tokens (0, or 1) counts nothing streamed
            message = obj.get("message") or {}
            self._take_model(message.get("model"))
            usage = message.get("usage")
            if isinstance(usage, dict):
                self._take_usage({k: v for k, v in usage.items() if k != "output_tokens"})
        elif kind == "message_delta":
            self._take_usage(obj.get("usage"))
        elif kind == "message_stop":
            self.ended = True
        elif kind == "content_block_start":
            block = obj.get("content_block") or {}
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self.text_parts.append(str(block.get("name") or ""))
        elif kind == "content_block_delta":
            delta = obj.get("delta") or {}
            if isinstance(delta, dict):
                self.text_parts.append(str(delta.get("text") or delta.get("partial_json") or ""))

    def _on_responses_event(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        response = obj.get("response")
        if isinstance(response, dict):  # created / in_progress: the model; the end: usage
            self._take_model(response.get("model"))
            self._take_usage(response.get("usage"))
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.ended = True
            self.response = response if isinstance(response, dict) else None
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self.text_parts.append(str(obj.get("delta") or ""))
        elif kind == "response.output_item.added":
            item = obj.get("item") or {}
            if isinstance(item, dict) and item.get("type") == "function_call":
                self.text_parts.append(str(item.get("name") or ""))

    def _take_model(self, model: Any) -> None:
        if self.served_model is None and isinstance(model, str) and model:
            self.served_model = model

    def _take_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if "prompt_tokens" in usage or "completion_tokens" in usage:
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
            return
        if "input_tokens" in usage:
            self.prompt_tokens = sum(int(usage.get(k) or 0) for k in (
                "input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
        if "output_tokens" in usage:
            self.completion_tokens = int(usage.get("output_tokens") or 0)

    def _take_text(self, obj: dict[str, Any]) -> None:
        if self.protocol == "responses":
            for item in obj.get("output") or []:
                if not isinstance(item, dict):
                    continue
                if item.get("type") == "function_call":
                    self.text_parts += [str(item.get("name") or ""),
                                        str(item.get("arguments") or "")]
                for part in item.get("content") or [] if item.get("type") == "message" else []:
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        self.text_parts.append(str(part.get("text") or ""))
            return
        if self.protocol == "anthropic":
            for block in obj.get("content") or []:
                if isinstance(block, dict) and block.get("type") == "text":
                    self.text_parts.append(str(block.get("text") or ""))
                elif isinstance(block, dict) and block.get("type") == "tool_use":
                    self.text_parts += [str(block.get("name") or ""),
                                        json.dumps(block.get("input"))]
            return
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            text = text if text is not None else choice.get("text")
            if isinstance(text, str):
                self.text_parts.append(text)
            if isinstance(delta, dict):
                self._take_tool_calls(delta.get("tool_calls"))

    def _take_tool_calls(self, calls: Any) -> None:
        """A tool call's name and arguments (streamed: in pieces), what the model generated
        for it: for the audit log and for counting an aborted stream's tokens (both saw
        only `content`, so a stream of tool calls was recorded empty and, cut short, as
        0 completion tokens)."""
        for call in calls if isinstance(calls, list) else []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                self.text_parts += [str(function[k]) for k in ("name", "arguments")
                                    if isinstance(function.get(k), str)]
