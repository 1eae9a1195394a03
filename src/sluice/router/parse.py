"""What the router reads from a request body before forwarding it untouched.

The router never validates OpenAI parameters (the worker does, and answers 400 naming
them); it only needs the model name, whether the response streams, the prompt (to count
and hash its tokens), a session key, and `max_tokens`. Anthropic `/v1/messages` bodies
are read into OpenAI-style messages so that the same tokenization applies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.protocol.errors import InvalidRequestError

CHAT, COMPLETION, MESSAGES = "chat", "completion", "messages"
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class ParsedRequest:
    kind: str
    body: dict[str, Any]
    model: str
    stream: bool
    raw: bytes = b""
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    session_key: str | None = None
    max_tokens: int | None = None

    @property
    def approx_chars(self) -> int:
        if self.messages is not None:
            return sum(len(m["content"]) + 8 for m in self.messages)
        return len(self.prompt or "")


def load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


def _text(content: Any) -> str:
    """Flatten OpenAI / Anthropic content (a string or a list of parts) to its text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _chat_messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list):
        raise InvalidRequestError("'messages' must be a list", param="messages")
    return [{"role": str(m.get("role", "user")), "content": _text(m.get("content"))}
            for m in raw if isinstance(m, dict)]


def _anthropic_messages(body: Mapping[str, Any]) -> list[dict[str, str]]:
    system = _text(body.get("system"))
    return ([{"role": "system", "content": system}] if system else []) + _chat_messages(
        body.get("messages"))


def parse_request(kind: str, raw: bytes, headers: Mapping[str, str]) -> ParsedRequest:
    """Read the routing-relevant fields of an OpenAI / Anthropic request body."""
    body = load_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' is required and must be a string", param="model")
    session = headers.get(SESSION_HEADER) or body.get("user")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    common: dict[str, Any] = dict(
        kind=kind, body=body, raw=raw, model=model, stream=bool(body.get("stream", False)),
        session_key=str(session) if session else None,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None)
    if kind == CHAT:
        return ParsedRequest(messages=_chat_messages(body.get("messages")), **common)
    if kind == MESSAGES:
        return ParsedRequest(messages=_anthropic_messages(body), **common)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ParsedRequest(prompt_ids=list(prompt), **common)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    return ParsedRequest(prompt=prompt if isinstance(prompt, str) else None, **common)
