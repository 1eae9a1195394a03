"""The router's span of one routed request: `route {model}`, from the request to the
last byte relayed back.

`routed.route` calls `traced_route` only when tracing is on. The span is the parent the
worker sees: the `traceparent` in the headers sent on is replaced by the span's before
routing. It ends when the relay closes (the whole stream), or at once for an error reply.

Attributes: `gen_ai.request.model`, `sluice.router.policy`, the chosen worker as
`server.address` + `server.port` (host and port, as OpenTelemetry's conventions define
them) and `sluice.router.worker` (its URL, the `worker` label of the router's metrics),
`sluice.router.prompt_tokens` and `sluice.router.estimated_cached_tokens` (what the
policy expected cached there; the worker's span has the actual
`gen_ai.usage.cache_read.input_tokens`), `sluice.router.retries` (attempts that failed
elsewhere first), `http.response.status_code`. A stream that migrated to another worker
mid-way (migrate.py) ends naming the worker that finished it, with
`sluice.router.first_worker` and `sluice.router.migrations`; the resumed request's
worker span is a second child of the route span.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from sluice.observe.tracing import Span, Tracing, replace_trace_headers, set_error

Headers = list[tuple[bytes, bytes]]
Inner = Callable[..., Awaitable[Any]]


async def traced_route(tracing: Tracing, inner: Inner, state: Any, kind: str, path: str,
                       body: bytes, headers: Headers) -> Any:
    """`inner(state, kind, path, body, headers, notes)` inside the router's span."""
    span = tracing.start("route", tracing.extract(headers), "CLIENT",
                         {"sluice.component": "router", "url.path": path})
    notes: dict[str, str] = {}
    try:
        reply = await inner(state, kind, path, body,
                            replace_trace_headers(headers, tracing, span), notes)
    except BaseException as exc:
        span.record_exception(exc)
        span.end()
        raise
    attrs: dict[str, Any] = {}
    if "model" in notes:
        span.update_name(f"route {notes['model']}")
        attrs.update({"gen_ai.request.model": notes["model"],
                      "sluice.router.policy": notes["policy"]})
    ticket = getattr(reply, "ticket", None)
    if ticket is not None:
        attrs.update({**_server(ticket.endpoint.url),
                      "sluice.router.retries": reply.retries,
                      "sluice.router.prompt_tokens": ticket.prompt_tokens,
                      "sluice.router.estimated_cached_tokens":
                          max(ticket.prompt_tokens - ticket.uncached_tokens, 0)})
    set_error(span, int(reply.status), attrs)
    if ticket is None:  # an error reply: nothing streams
        span.end()
    else:  # after what the routed path hung there (release.py's stream record)
        reply.on_close = _then(reply.on_close, lambda relay: _ended(span, relay))
    return reply


def _ended(span: Span, relay: Any) -> None:
    """End the span; a stream that migrated (migrate.py) names the worker that finished
    it, keeps the first as `sluice.router.first_worker`, and counts the moves."""
    migrations = getattr(relay, "migrations", 0)
    if migrations:
        first = span.attributes.get("sluice.router.worker")
        span.set_attributes({**_server(relay.ticket.endpoint.url),
                             "sluice.router.first_worker": first,
                             "sluice.router.migrations": migrations})
    span.end()


def _server(url: str) -> dict[str, Any]:
    """`server.address` (host, no scheme) and `server.port` of a worker URL, and the URL."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return {"server.address": parts.hostname or url, "server.port": port,
            "sluice.router.worker": url}


def _then(first: Callable[[Any], None] | None, second: Callable[[Any], None]
          ) -> Callable[[Any], None]:
    def both(relay: Any) -> None:
        try:
            if first is not None:
                first(relay)
        finally:
            second(relay)

    return both
