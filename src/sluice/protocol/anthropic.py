"""Anthropic Messages API wire types, and the translation to and from OpenAI chat.

sluice serves `/v1/messages` by translating: the Anthropic request becomes an OpenAI
chat request (`to_chat_body`), the OpenAI response or stream comes back as Anthropic
(`from_chat_response`, `StreamTranslator`). Both directions work on plain dicts so
that the gateway can translate in front of any OpenAI upstream, not only sluice's
worker.

    Anthropic                         OpenAI chat
    system (str | text blocks)   ->   messages[0] {"role": "system"}
    messages[].content blocks    ->   content string (text blocks joined)
    max_tokens / stop_sequences  ->   max_tokens / stop
    stop_reason                  <-   finish_reason "length" -> "max_tokens";
                                      "stop" + stop_reason in stop_sequences
                                      -> "stop_sequence"; otherwise "end_turn"

Streaming asks the upstream for usage in every chunk (vLLM's `continuous_usage_stats`)
so that `message_start` can report the input tokens. Errors use Anthropic's shape:
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sluice.protocol.errors import InvalidRequestError, SluiceError


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Parameters Anthropic defines that sluice does not implement: a 400 naming them.
UNSUPPORTED_MESSAGES: tuple[str, ...] = (
    "tools", "tool_choice", "thinking", "container", "mcp_servers", "service_tier",
)


def reject_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_MESSAGES:
        if body.get(name) not in (None, [], {}):
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    # Accepted and honoured implicitly: sluice's prefix cache caches every prompt.
    cache_control: dict[str, Any] | None = None


def _text_blocks_only(value: Any) -> Any:
    for block in value if isinstance(value, list) else []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise ValueError(f"content block type {kind!r} is not supported (only 'text')")
    return value


def _join(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    _check = field_validator("content", mode="before")(_text_blocks_only)


class Metadata(AnthropicModel):
    user_id: str | None = None


class MessagesRequest(AnthropicModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # Accepted and honoured implicitly: sluice's prefix cache caches every prompt.
    cache_control: dict[str, Any] | None = None

    _check = field_validator("system", mode="before")(_text_blocks_only)


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- translation


def to_chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The OpenAI chat request equivalent to an Anthropic Messages request."""
    messages: list[dict[str, str]] = []
    if system := _join(req.system or ""):  # an empty system prompt is no message (prompt.py)
        messages.append({"role": "system", "content": system})
    messages += [{"role": m.role, "content": _join(m.content)} for m in req.messages]
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens}
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "stop": req.stop_sequences or None,
                "user": req.metadata.user_id if req.metadata else None}
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def stop_reason(finish_reason: str | None, matched: Any,
                stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from OpenAI's finish_reason and vLLM's stop_reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason is None:
        return None, None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def from_chat_response(resp: dict[str, Any], req: MessagesRequest) -> MessagesResponse:
    """The Anthropic response for an OpenAI chat completion (first choice)."""
    choice = resp["choices"][0]
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   req.stop_sequences)
    usage = resp.get("usage") or {}
    return MessagesResponse(
        id=new_message_id(),
        content=[{"type": "text", "text": choice["message"].get("content") or ""}],
        model=req.model, stop_reason=reason, stop_sequence=sequence,
        usage=Usage(input_tokens=usage.get("prompt_tokens", 0),
                    output_tokens=usage.get("completion_tokens", 0)),
    )


Event = tuple[str, dict[str, Any]]


class StreamTranslator:
    """Turns a stream of OpenAI chat chunks (dicts) into Anthropic stream events.

    Feed every chunk to `feed`, then call `finish` once; both return the events to send
    in order. Holds the running usage and the stop reason; not thread-safe.
    """

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req
        self.id = new_message_id()
        self.started = False
        self.usage = Usage()
        self.reason: str | None = None
        self.sequence: str | None = None

    def _start(self) -> list[Event]:
        self.started = True
        message = MessagesResponse(id=self.id, content=[], model=self.req.model,
                                   usage=Usage(input_tokens=self.usage.input_tokens))
        return [
            ("message_start", {"type": "message_start", "message": message.model_dump()}),
            ("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "text", "text": ""}}),
            ("ping", {"type": "ping"}),
        ]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        if chunk.get("usage"):
            self.usage = Usage(input_tokens=chunk["usage"].get("prompt_tokens", 0),
                               output_tokens=chunk["usage"].get("completion_tokens", 0))
        events = [] if self.started else self._start()
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                events.append(("content_block_delta", {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}}))
            if choice.get("finish_reason"):
                self.reason, self.sequence = stop_reason(
                    choice["finish_reason"], choice.get("stop_reason"), self.req.stop_sequences)
        return events

    def finish(self) -> list[Event]:
        events = [] if self.started else self._start()
        return events + [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": self.reason,
                                         "stop_sequence": self.sequence},
                               "usage": {"output_tokens": self.usage.output_tokens}}),
            ("message_stop", {"type": "message_stop"}),
        ]


def sse(event: Event) -> str:
    """One Anthropic server-sent event."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


# --------------------------------------------------------------------------- errors

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}


def error_body(exc: SluiceError) -> dict[str, Any]:
    """Anthropic's error JSON for a sluice error."""
    kind = ERROR_TYPES.get(exc.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}
