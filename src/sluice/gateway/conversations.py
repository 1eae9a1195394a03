"""OpenAI's Conversations API, kept by the gateway (as its stored responses are:
gateway/responses.py): a conversation is a list of items that Responses requests read
and extend.

    POST   /v1/conversations                          {items?, metadata?}: a new one
    GET    /v1/conversations/{id}                     the conversation object
    POST   /v1/conversations/{id}                     {metadata}: replaced
    DELETE /v1/conversations/{id}                     it and its items
    GET    /v1/conversations/{id}/items               its items (`limit` 1-100, default
                                                      20; `order` desc by default;
                                                      `after`)
    POST   /v1/conversations/{id}/items               {items}: appended
    GET    /v1/conversations/{id}/items/{item_id}     one item
    DELETE /v1/conversations/{id}/items/{item_id}     one item (answers the conversation)

A Responses request with `conversation` (its id, or `{"id"}`) reads the conversation's
items before its own input, and once it has its answer (completed or cut at
`max_output_tokens`), its input items and output items are appended, before the client
has its last bytes; its Response says `"conversation": {"id"}`. `conversation` and
`previous_response_id` together are a 400, as in OpenAI's API. At most 20 items a
create or append, as OpenAI allows; metadata as OpenAI's: at most 16 string pairs, keys
up to 64 characters, values up to 512. A conversation is a tenant's: another's id is a
404, as an unknown one. Conversations do not expire (OpenAI keeps them until deleted).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from sluice.gateway.items import db_call, input_items, only_params, page, query_params
from sluice.gateway.store import Store, StoredConversation
from sluice.protocol.errors import InvalidRequestError, MethodNotAllowedError, NotFoundError
from sluice.protocol.responses import new_id

PATH = "/v1/conversations"
_ROUTE = re.compile(r"^/v1/conversations(?:/(?P<id>[^/]+)(?P<items>/items(?:/(?P<item>[^/]+))?)?)?$")
MAX_ITEMS = 20  # a create or an append, as OpenAI's API allows


def conversation_route(path: str) -> str | None:
    """The route template of a Conversations API path (what the ledger records), or None."""
    match = _ROUTE.match(path)
    if match is None:
        return None
    route = PATH
    if match["id"] is not None:
        route += "/{conversation_id}"
    if match["items"] is not None:
        route += "/items" + ("/{item_id}" if match["item"] is not None else "")
    return route


def conversation_id_of(value: Any) -> str:
    """A Responses request's `conversation`: its id, or an object with one."""
    if isinstance(value, Mapping):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("'conversation' must be a conversation id or an object "
                                  "with its 'id'", param="conversation")
    return value


def not_found(conversation_id: str, param: str = "conversation_id") -> NotFoundError:
    return NotFoundError(f"Conversation with id {conversation_id!r} not found.", param=param,
                         code="conversation_not_found")


class Conversations:
    """The Conversations API's routes (module docstring), on the gateway's `Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def items(self, conversation_id: str, tenant_id: str,
                    param: str = "conversation") -> list[Any]:
        """Its items, oldest first (a Responses request's `conversation`)."""
        found = await db_call(self.store.conversation_items, conversation_id, tenant_id)
        if found is None:
            raise not_found(conversation_id, param)
        return found

    async def append(self, conversation_id: str, tenant_id: str, items: list[Any]) -> None:
        if not await db_call(self.store.add_conversation_items, conversation_id, tenant_id,
                             items):
            raise not_found(conversation_id, "conversation")

    async def answer(self, method: str, path: str, query: bytes, body: bytes,
                     tenant_id: str) -> dict[str, Any]:
        """A route's JSON (200), or a `SluiceError`."""
        match = _ROUTE.match(path)
        assert match is not None
        cid, item = match["id"], match["item"]
        params = query_params(query)
        if cid is None:
            if method != "POST":
                raise _not_allowed(method, PATH)
            return await self._create(_object(body), tenant_id)
        if match["items"] is None:
            return await self._conversation(method, cid, _object(body) if method == "POST"
                                            else {}, tenant_id, params)
        if item is None:
            if method == "GET":
                only_params(params, {"limit": None, "order": ("asc", "desc"), "after": None,
                                     "include": ("",)})
                return page(await self.items(cid, tenant_id, "conversation_id"), params)
            if method != "POST":
                raise _not_allowed(method, PATH + "/{conversation_id}/items")
            only_params(params, {"include": ("",)})
            request = _object(body)
            _fields(request, ("items",))
            items = _new_items(request.get("items"), required=True)
            await self.append(cid, tenant_id, items)
            return {"object": "list", "data": items, "first_id": items[0]["id"],
                    "last_id": items[-1]["id"], "has_more": False}
        only_params(params, {"include": ("",)})
        if method == "GET":
            for found in await self.items(cid, tenant_id, "conversation_id"):
                if isinstance(found, dict) and found.get("id") == item:
                    return found
            raise _item_not_found(item)
        if method == "DELETE":
            if not await db_call(self.store.delete_conversation_item, cid, tenant_id, item):
                if await db_call(self.store.get_conversation, cid, tenant_id) is None:
                    raise not_found(cid)
                raise _item_not_found(item)
            return await self._conversation("GET", cid, {}, tenant_id, {})
        raise _not_allowed(method, PATH + "/{conversation_id}/items/{item_id}")

    async def _create(self, request: dict[str, Any], tenant_id: str) -> dict[str, Any]:
        _fields(request, ("items", "metadata"))
        conversation = StoredConversation(new_id("conv"), tenant_id,
                                          _metadata(request.get("metadata")), time.time())
        items = _new_items(request.get("items"), required=False)
        await db_call(self.store.create_conversation, conversation, items)
        return _shown(conversation)

    async def _conversation(self, method: str, cid: str, request: dict[str, Any],
                            tenant_id: str, params: dict[str, str]) -> dict[str, Any]:
        only_params(params, {})
        if method == "GET":
            found = await db_call(self.store.get_conversation, cid, tenant_id)
        elif method == "POST":
            _fields(request, ("metadata",))
            if "metadata" not in request:
                raise InvalidRequestError("'metadata' is required", param="metadata")
            found = await db_call(self.store.update_conversation, cid, tenant_id,
                                  _metadata(request["metadata"]))
        elif method == "DELETE":
            if not await db_call(self.store.delete_conversation, cid, tenant_id):
                raise not_found(cid)
            return {"id": cid, "object": "conversation.deleted", "deleted": True}
        else:
            raise _not_allowed(method, PATH + "/{conversation_id}")
        if found is None:
            raise not_found(cid)
        return _shown(found)


def _shown(conversation: StoredConversation) -> dict[str, Any]:
    return {"id": conversation.id, "object": "conversation",
            "created_at": int(conversation.created_at), "metadata": conversation.metadata}


def _object(body: bytes) -> dict[str, Any]:
    from sluice.protocol.edge import load_json_object

    return load_json_object(body or b"{}", param="body")


def _fields(request: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for name in request:
        if name not in allowed:
            raise InvalidRequestError(f"Unknown parameter: '{name}'.", param=name)


def _metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: up to 16 pairs of strings (keys ≤ 64 characters, values ≤ 512)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in value.items()):
        raise InvalidRequestError("'metadata' must be an object of at most 16 string pairs "
                                  "(keys up to 64 characters, values up to 512)",
                                  param="metadata")
    return dict(value)


def _new_items(raw: Any, *, required: bool) -> list[dict[str, Any]]:
    """Items for a conversation, as the Responses prompt view reads them (a 400 naming
    the item otherwise), each with an id."""
    from sluice.protocol.responses import chat_prompt

    if raw is None and not required:
        return []
    if not isinstance(raw, list) or (required and not raw) or len(raw) > MAX_ITEMS:
        raise InvalidRequestError(f"'items' must be a list of 1 to {MAX_ITEMS} input items",
                                  param="items")
    items = input_items(raw)
    if items:
        try:
            chat_prompt({"input": items})
        except InvalidRequestError as exc:
            exc.param = (exc.param or "input").replace("input", "items", 1)
            raise
    return items


def _item_not_found(item_id: str) -> NotFoundError:
    return NotFoundError(f"Item with id {item_id!r} not found.", param="item_id",
                         code="item_not_found")


def _not_allowed(method: str, route: str) -> MethodNotAllowedError:
    return MethodNotAllowedError(f"{method} is not allowed on {route}")
