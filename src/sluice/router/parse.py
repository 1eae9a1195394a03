"""What the router reads from a request body before forwarding it untouched.

The router never validates OpenAI parameters (the worker does, and answers 400 naming
them); it only needs the model name, whether the response streams, the prompt (to count
and hash its tokens), a session key, and `max_tokens`. The prompt is read
through the one prompt view (`sluice.protocol.prompt`), the same rules the gateway counts
and the worker templates by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sluice.protocol.edge import load_json_object, refuse_kv_transfer_params
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.prompt import (
    CHAT,
    COMPLETION,
    MESSAGES,
    RESPONSES,
    PromptView,
    ReadRequest,
    prompt_view,
)

SESSION_HEADER = "x-session-id"
__all__ = ["CHAT", "COMPLETION", "MESSAGES", "RESPONSES", "ParsedRequest", "parse_request"]


@dataclass(frozen=True)
class ParsedRequest:
    kind: str
    body: dict[str, Any]
    model: str
    stream: bool
    raw: bytes = b""
    view: PromptView | None = None  # None: a prompt the worker will refuse (or judge)
    session_key: str | None = None
    max_tokens: int | None = None

    @property
    def prompt_ids(self) -> list[int] | None:
        """The client's token ids, for a completion prompt given as ids."""
        texts = self.view.texts if self.view is not None else ()
        return texts[0] if len(texts) == 1 and isinstance(texts[0], list) else None

    @property
    def approx_chars(self) -> int:
        return self.view.chars if self.view is not None else 0


def _view(kind: str, body: dict[str, Any]) -> PromptView | None:
    """The one prompt view (`sluice.protocol.prompt`); a prompt it refuses (images, say)
    is routed on load alone and left to the worker to judge."""
    try:
        return prompt_view(kind, body)
    except InvalidRequestError:
        return None


def parse_request(kind: str, raw: bytes, headers: Mapping[str, str],
                  read: ReadRequest | None = None) -> ParsedRequest:
    """Read the routing-relevant fields of an OpenAI / Anthropic request body. `read`:
    what the gateway in front, in this process, read from these very bytes (its object
    and prompt view), taken instead of reading them again."""
    if read is not None and read.body is raw:
        body, view = read.payload, read.view if read.kind == kind else None
    else:
        body, view = load_json_object(raw, param="body"), None
    refuse_kv_transfer_params(body)  # the router's own P/D requests are made, not parsed
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("'model' is required and must be a string", param="model")
    session = headers.get(SESSION_HEADER) or body.get("user")
    max_tokens = body.get("max_output_tokens") if kind == RESPONSES else \
        body.get("max_completion_tokens", body.get("max_tokens"))
    return ParsedRequest(
        kind=kind, body=body, raw=raw, model=model, stream=bool(body.get("stream", False)),
        view=view if view is not None else _view(kind, body),
        session_key=str(session) if session else None,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None)
