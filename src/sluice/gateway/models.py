"""`/v1/models` as the calling key sees it: only the models it may use.

A key may use a model iff every allow list above it names the model (the tenant's and
the key's; `None` means unrestricted). The same rule that refuses a generation request
with 404 `model_not_found` shapes the listing, so a client never sees a model it
cannot call:

    GET /v1/models        upstream's list, entries of `data` whose `id` is not allowed
                          removed (the rest of the document kept as is)
    GET /v1/models/{id}   404 `model_not_found` (OpenAI's error JSON) when `id` is not
                          allowed, before the upstream is asked; else forwarded

An unrestricted key's requests pass through untouched. `ModelListFilter` is an ASGI
`send` wrapper: it holds the list response back until its last body chunk, filters it
and sends it with a corrected `content-length`; any response that is not a 200 JSON
object with a `data` list goes out unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from sluice.gateway.store import Principal

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

MODELS_PATH = "/v1/models"
MODEL_PREFIX = "/v1/models/"


def allowed_models(principal: Principal) -> frozenset[str] | None:
    """The models this key may use: the intersection of its tenant's and its own allow
    lists; None when neither restricts."""
    lists = [frozenset(m) for m in (principal.tenant.settings.allowed_models,
                                    principal.key.settings.allowed_models) if m is not None]
    return frozenset.intersection(*lists) if lists else None


def filter_model_list(body: bytes, allowed: frozenset[str]) -> bytes | None:
    """The list document with only allowed entries, or None if `body` is not one."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    doc["data"] = [m for m in doc["data"] if isinstance(m, dict) and m.get("id") in allowed]
    return json.dumps(doc).encode()


class ModelListFilter:
    """Wraps `send` for one `GET /v1/models` response; buffers it, then filters it."""

    def __init__(self, send: Send, allowed: frozenset[str]) -> None:
        self.send = send
        self.allowed = allowed
        self.start: Message | None = None
        self.chunks: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            return
        if message["type"] != "http.response.body" or self.start is None:
            return await self.send(message)
        self.chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self.chunks)
        filtered = filter_model_list(body, self.allowed) if self.start["status"] == 200 else None
        if filtered is not None:
            body = filtered
        headers = [(k, v) for k, v in self.start.get("headers") or []
                   if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.send({**self.start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
