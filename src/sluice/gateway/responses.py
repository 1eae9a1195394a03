"""The Responses API's conversation state, kept by the gateway: `store`,
`previous_response_id`, and the stored-response routes.

The worker serves `/v1/responses` stateless (protocol/responses.py); the gateway, which
has a database (SQLite or PostgreSQL, shared by its replicas), keeps the responses, as
LiteLLM's proxy does for providers without a store, so any worker behind the router can
answer any turn of a conversation:

    admission    `previous_response_id`: the stored chain it ends (each response's input
                 items, then its output items, oldest first) goes before the request's
                 own input, and the field is removed; `store` (OpenAI's default: true)
                 is sent as false. The worker then sees one stateless request, and the
                 prompt is counted for TPM and budgets, and tokenized, as it sees it. A
                 previous response of another tenant is not found (404).
    the answer   each Response object passed on (the JSON body; in a stream, the events
                 that carry one) says `"store": true` and the `previous_response_id` the
                 client sent (`Conversation.patch`, applied by the meter).
    settlement   the final Response (completed, incomplete or failed) is saved with the
                 request's input items (ids given where the client sent none) before the
                 client has its last bytes, so the next turn finds it. A stream the
                 client left is not saved (it has no final Response).
    routes       GET /v1/responses/{id} (the Response), DELETE /v1/responses/{id}, GET
                 /v1/responses/{id}/input_items (the items that produced it: its whole
                 conversation, `limit` 1-100, `order` desc by default, `after` /
                 `before`), POST /v1/responses/{id}/cancel (a 400: only background
                 responses, which sluice does not run, can be cancelled).

As OpenAI's API, the instructions and tools of a previous response are not carried
over. Responses are kept `--response-retention` days (30, OpenAI's); with 0 the gateway
keeps none, and the worker's answers (`store` must be false, `previous_response_id` a
400) stand.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from sluice.gateway.store import Store, StoredResponse
from sluice.protocol.errors import (
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.protocol.responses import INPUT_TOKENS_PATH, PATH, new_id

# The requests whose `previous_response_id` the gateway expands (the input-token count
# too: it counts what the request would send).
ENDPOINTS = (PATH, INPUT_TOKENS_PATH)
# A stored response's routes, by the path's shape: (the ledger's endpoint, the action).
_ROUTE = re.compile(r"^/v1/responses/(?P<id>[^/]+)(?P<rest>/input_items|/cancel)?$")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}
_END_STATUSES = ("completed", "incomplete", "failed")
MAX_CHAIN = 10_000  # responses in one conversation
T = TypeVar("T")


def stored_route(path: str) -> str | None:
    """The route template of a stored response's path (what the ledger records), or None."""
    match = _ROUTE.match(path)
    if match is None or match["id"] == "input_tokens":
        return None
    return PATH + "/{response_id}" + (match["rest"] or "")


@dataclass
class Conversation:
    """What admission decided for one Responses request."""

    store: bool  # keep its final Response
    previous_id: str | None
    input_items: list[Any] = field(default_factory=list)  # its own, ids given

    @property
    def patch(self) -> dict[str, Any]:
        """The fields every Response object passed on to the client gets."""
        fields: dict[str, Any] = {"store": True} if self.store else {}
        if self.previous_id is not None:
            fields["previous_response_id"] = self.previous_id
        return fields


def input_items(raw: Any) -> list[Any]:
    """A request's `input` as items: a string is one user message; a message's string
    content is one text part; each item without an id gets one. Shapes that are not
    items are kept as they are, for the prompt view to refuse (a 400 naming them)."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        return raw if raw is not None else []
    out: list[Any] = []
    for item in raw:
        if not isinstance(item, Mapping):
            out.append(item)
            continue
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not isinstance(item.get("id"), str):
            item["id"] = new_id(_ITEM_PREFIX.get(str(kind), "item"))
        out.append(item)
    return out


def output_items(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A stored Response's output, as the input items of a later turn."""
    return [item for item in response.get("output") or [] if isinstance(item, dict)]


class StoredResponses:
    """The gateway's side of `store` (module docstring), on its `Store`."""

    def __init__(self, store: Store, retention_s: float) -> None:
        self.store = store
        self.retention_s = retention_s

    @property
    def enabled(self) -> bool:
        return self.retention_s > 0

    # -- admission ---------------------------------------------------------------------

    async def prepare(self, payload: dict[str, Any], tenant_id: str,
                      endpoint: str) -> Conversation | None:
        """Expand `previous_response_id` into `payload["input"]` and send `store` false
        (module docstring); None when the request needs nothing of the store (`store`
        false and no previous response; or a store of 0 days, where the worker answers
        `store` itself)."""
        previous = payload.get("previous_response_id")
        asked = payload.get("store", True) if endpoint == PATH else False
        if not self.enabled:
            if previous is not None:
                raise InvalidRequestError(
                    "previous_response_id: this gateway keeps no responses "
                    "(--response-retention 0); send the whole conversation as 'input'",
                    param="previous_response_id")
            return None
        if previous is not None and not isinstance(previous, str):
            raise InvalidRequestError("'previous_response_id' must be a string",
                                      param="previous_response_id")
        if asked not in (True, False, None):
            raise InvalidRequestError("'store' must be a boolean", param="store")
        if asked is False and previous is None:
            return None  # the request goes as it came, and nothing is kept
        conversation = Conversation(store=asked is not False, previous_id=previous,
                                    input_items=input_items(payload.get("input")))
        if previous is not None:
            if not isinstance(conversation.input_items, list):
                raise InvalidRequestError("'input' must be a string or a list of input items",
                                          param="input")
            history = await self._db(self.history, previous, tenant_id)
            payload["input"] = history + conversation.input_items
            del payload["previous_response_id"]
        if conversation.store:
            payload["store"] = False
        return conversation

    def history(self, response_id: str, tenant_id: str) -> list[Any]:
        """The items of the conversation that `response_id` ends: each response's input
        items, then its output, oldest first."""
        chain: list[StoredResponse] = []
        next_id: str | None = response_id
        while next_id is not None:
            stored = self.store.get_response(next_id, tenant_id)
            if stored is None:
                raise NotFoundError(
                    f"Previous response with id {next_id!r} not found"
                    + (" (an earlier response of its conversation was deleted or expired)"
                       if next_id != response_id else "."),
                    param="previous_response_id", code="previous_response_not_found")
            chain.append(stored)
            if len(chain) > MAX_CHAIN:
                raise InvalidRequestError(f"the conversation is longer than {MAX_CHAIN} "
                                          "responses", param="previous_response_id")
            next_id = stored.previous_id
        items: list[Any] = []
        for stored in reversed(chain):
            items += stored.input_items + output_items(stored.response)
        return items

    # -- settlement --------------------------------------------------------------------

    async def save(self, conversation: Conversation, response: dict[str, Any],
                   tenant_id: str, key_id: str) -> bool:
        """Keep a final Response (not one still in progress); whether it was kept."""
        if not conversation.store or response.get("status") not in _END_STATUSES \
                or not isinstance(response.get("id"), str):
            return False
        created = response.get("created_at")
        at = float(created) if isinstance(created, (int, float)) else time.time()
        stored = StoredResponse(response["id"], tenant_id, key_id, conversation.previous_id,
                                conversation.input_items, response, created_at=at,
                                expires_at=at + self.retention_s)
        await self._db(self.store.save_response, stored)
        return True

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread; a database that fails is a 503 saying so (a
        `SluiceError`, such as a 404, passes as it is)."""
        try:
            return await asyncio.to_thread(fn, *args)
        except SluiceError:
            raise
        except Exception as exc:
            raise ServiceUnavailableError(
                f"the gateway's response store is unreachable ({type(exc).__name__}); "
                "retry shortly", code="response_store_unavailable") from exc

    # -- the routes --------------------------------------------------------------------

    async def answer(self, method: str, path: str, query: bytes,
                     tenant_id: str) -> dict[str, Any]:
        """A stored response's route (module docstring): the JSON to answer 200 with, or
        a `SluiceError` (404 for an id this tenant has no response under)."""
        match = _ROUTE.match(path)
        assert match is not None
        response_id, rest = match["id"], match["rest"] or ""
        params = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))
        action = (method, rest)
        if action == ("GET", ""):
            _only(params, {"stream": ("false",)})
            return (await self._find(response_id, tenant_id)).response
        if action == ("DELETE", ""):
            _only(params, {})
            if not await self._db(self.store.delete_response, response_id, tenant_id):
                raise _not_found(response_id)
            return {"id": response_id, "object": "response.deleted", "deleted": True}
        if action == ("GET", "/input_items"):
            return await self._input_items(response_id, tenant_id, params)
        if action == ("POST", "/cancel"):
            await self._find(response_id, tenant_id)
            raise InvalidRequestError("Only responses created with 'background': true can "
                                      "be cancelled; this one ran in the foreground and has "
                                      "ended", param="response_id")
        error = SluiceError(f"{method} is not allowed on {PATH}/{{response_id}}{rest}")
        error.status_code = 405
        raise error

    async def _find(self, response_id: str, tenant_id: str) -> StoredResponse:
        stored = await self._db(self.store.get_response, response_id, tenant_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    async def _input_items(self, response_id: str, tenant_id: str,
                           params: dict[str, str]) -> dict[str, Any]:
        _only(params, {"limit": None, "order": ("asc", "desc"), "after": None,
                       "before": None, "include": ("",)})
        limit = params.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise InvalidRequestError("'limit' must be an integer from 1 to 100", param="limit")
        stored = await self._find(response_id, tenant_id)
        items = stored.input_items
        if stored.previous_id is not None:
            items = await self._db(self.history, stored.previous_id, tenant_id) + items
        if params.get("order", "desc") == "desc":
            items = items[::-1]
        ids = [item.get("id") if isinstance(item, dict) else None for item in items]
        start, end = 0, len(items)
        for name in ("after", "before"):
            if name in params and params[name] not in ids:
                raise InvalidRequestError(f"no input item with id {params[name]!r} in this "
                                          "response", param=name)
        if "after" in params:
            start = ids.index(params["after"]) + 1
        if "before" in params:
            end = ids.index(params["before"])
        items = items[start:end]
        page = items[:int(limit)]
        return {"object": "list", "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(items) > len(page)}


def _only(params: Mapping[str, str], allowed: Mapping[str, tuple[str, ...] | None]) -> None:
    """Refuse a query parameter not in `allowed`, or with a value it does not list."""
    for name, value in params.items():
        name = name.removesuffix("[]")
        values = allowed.get(name, ())
        if name not in allowed or values is not None and value not in values:
            raise InvalidRequestError(f"query parameter {name}={value!r} is not supported "
                                      "here", param=name)


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id {response_id!r} not found.", param="response_id",
                         code="response_not_found")
