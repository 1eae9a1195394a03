"""Items and lists of them, as OpenAI's stored-state APIs have them (the gateway's
stored responses, responses.py, and conversations, conversations.py): input items with
ids, a page of a list, the query parameters a route takes, and the store's calls on a
worker thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from sluice.protocol.errors import InvalidRequestError, ServiceUnavailableError, SluiceError
from sluice.protocol.responses import new_id

T = TypeVar("T")
_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                "reasoning": "rs"}


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


async def db_call(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` (a `Store` method) on a worker thread; a database that fails is a 503
    saying so (a `SluiceError`, such as a 404, passes as it is)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except SluiceError:
        raise
    except Exception as exc:
        raise ServiceUnavailableError(
            f"the gateway's response store is unreachable ({type(exc).__name__}); "
            "retry shortly", code="response_store_unavailable") from exc


def query_params(query: bytes) -> dict[str, str]:
    return dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True))


def page(items: list[Any], params: Mapping[str, str]) -> dict[str, Any]:
    """One page of a list of items, OpenAI's way: `limit` 1-100 (default 20), `order`
    desc (the default) or asc, `after` / `before` an item id; `has_more`."""
    limit = params.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise InvalidRequestError("'limit' must be an integer from 1 to 100", param="limit")
    if params.get("order", "desc") == "desc":
        items = items[::-1]
    ids = [item.get("id") if isinstance(item, dict) else None for item in items]
    start, end = 0, len(items)
    for name in ("after", "before"):
        if name in params and params[name] not in ids:
            raise InvalidRequestError(f"no item with id {params[name]!r} here", param=name)
    if "after" in params:
        start = ids.index(params["after"]) + 1
    if "before" in params:
        end = ids.index(params["before"])
    items = items[start:end]
    shown = items[:int(limit)]
    return {"object": "list", "data": shown,
            "first_id": shown[0].get("id") if shown else None,
            "last_id": shown[-1].get("id") if shown else None,
            "has_more": len(items) > len(shown)}


def only_params(params: Mapping[str, str],
                allowed: Mapping[str, tuple[str, ...] | None]) -> None:
    """Refuse a query parameter not in `allowed`, or with a value it does not list."""
    for name, value in params.items():
        name = name.removesuffix("[]")
        values = allowed.get(name, ())
        if name not in allowed or values is not None and value not in values:
            raise InvalidRequestError(f"query parameter {name}={value!r} is not supported "
                                      "here", param=name)
