"""Mid-stream request migration: a worker that fails after the first byte is replaced.

Before the first byte the proxy retries (proxy.py); after it, the client already has
part of the answer. Dynamo's frontend re-sends prompt + tokens so far to another
worker; so does sluice, with the generated tokens as ids (nothing re-tokenized):

    route: eligible stream (chat, completion, Anthropic message or Responses; n=1)
        -> body gets "return_token_ids": true (vLLM's field; the worker puts each
           choice's `token_ids` in its chunks, on Anthropic's and the Responses API's
           events a `token_ids` field, and its tokenizer in `x-sluice-tokenizer`)
        -> MigratingRelay around the proxy's Relay:
             complete SSE events only pass on; each one's token ids are kept; the
             `token_ids` field is cut from what the client sees unless it asked
             worker fails (read error, closed, an error event, no end event) first
               -> same body + `x-sluice-resume-ids: <tokenizer>.<ids so far>` to another
                  worker of the same release version (proxy.forward without the one
                  that just failed, nor one without the request's LoRA adapter; one
                  that failed earlier may serve again unless ejected; the baseline when
                  the version has no other), at most `limit` times
               -> the new worker templates the same prompt, appends the ids as output
                  (engine: detokenizer, grammar, seeded sampling continue from them;
                  tool-call parser, Anthropic and Responses event state replay their
                  text), sends no role chunk, message_start or response.created, and
                  counts the resumed ids in its usage
               -> its events pass on (OpenAI's with the first worker's `id`, `created`;
                  the Responses API's with its response id, `created_at`, item ids and
                  `sequence_number`s going on: `ResponsesIds`)

So the client sees one stream: one role chunk (one message_start, one
response.created), no repeated or missing text, one end event, usage once (the last
worker's: original prompt + every completion token). A stream that fails before its
first event is sent again whole (there is nothing to resume). Not migrated: n > 1,
echo, non-streamed requests (a failure there comes before the first byte: the proxy's
retry reruns it whole).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from typing import Any

from sluice.protocol.edge import error_event
from sluice.protocol.errors import SluiceError
from sluice.protocol.prompt import RESUME_HEADER, TOKENIZER_HEADER, ResumeIds
from sluice.protocol.responses import END_EVENTS, FAILED_EVENT, sse
from sluice.protocol.responses import error_event as responses_error_event
from sluice.router.buffer import RequestBuffer
from sluice.router.config import BASELINE
from sluice.router.parse import CHAT, COMPLETION, MESSAGES, RESPONSES, ParsedRequest
from sluice.router.policies import RequestMeta
from sluice.router.pool import Pool
from sluice.router.proxy import NoWorkerReached, Proxy, Relay
from sluice.router.release import VERSION_HEADER
from sluice.router.upstream import ReadError, UpstreamError

log = logging.getLogger(__name__)

_TOKEN_IDS = re.compile(rb',\s*"token_ids":\s*\[[\d,\s]*\]')
_IDS_IN = re.compile(rb'"token_ids":\s*\[([\d,\s]*)\]')
_RESUME = RESUME_HEADER.encode()
_TOKENIZER = TOKENIZER_HEADER.encode()


@dataclass(frozen=True)
class Dialect:
    """What the relay watches for in one API's stream (every pattern is matched on the
    bytes: no JSON decoding on the hot path)."""

    done: tuple[bytes, ...]  # the event that ends the stream starts with one of them
    error: bytes  # a worker's mid-stream error event starts with it
    finished: bytes | None  # in the event after which only the end is missing
    end: bytes  # the end event the router sends when only it is missing
    rewrite: bool  # resumed events get the first worker's `id` and `created`
    # the events every stream opens with, before any output: a stream that failed
    # within them is sent again whole, and the new stream's first ones dropped
    opening: int = 0


OPENAI = Dialect((b"data: [DONE]",), b'data: {"error"', b'"finish_reason":"',
                 b"data: [DONE]\n\n", rewrite=True)
ANTHROPIC = Dialect((b"event: message_stop",), b"event: error", b"event: message_delta",
                    b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
                    rewrite=False)
# (a Responses stream's end carries the whole Response, which only a worker can make:
# a stream that fails just before it is resumed, as any other)
RESPONSES_API = Dialect(tuple(f"event: {kind}".encode() for kind in END_EVENTS),
                        f"event: {FAILED_EVENT}".encode(), None, b"", rewrite=True, opening=2)


def migratable(req: ParsedRequest) -> bool:
    """A stream the router can resume elsewhere (see the module docstring)."""
    body = req.body
    return (req.stream and req.kind in (CHAT, COMPLETION, MESSAGES, RESPONSES)
            and body.get("n", 1) == 1
            and not body.get("echo") and isinstance(body.get("prompt", ""), str | list))


def with_token_ids(req: ParsedRequest) -> ParsedRequest:
    """The request with vLLM's `return_token_ids: true` (its raw body spliced, not
    re-encoded); unchanged when the client asked for the ids itself. A client's `false`
    is overridden (re-encoded: a spliced duplicate key would lose to the client's), and
    the relay cuts the ids from what it sees."""
    if req.body.get("return_token_ids") is True:
        return req
    body = {**req.body, "return_token_ids": True}
    if "return_token_ids" in req.body:
        raw = json.dumps(body).encode()
    else:
        start = req.raw.index(b"{") + 1
        rest = req.raw[start:].lstrip()
        sep = b"" if rest.startswith(b"}") else b","
        raw = req.raw[:start] + b'"return_token_ids":true' + sep + req.raw[start:]
    return ParsedRequest(req.kind, body, req.model, req.stream, raw, req.view,
                         req.session_key, req.max_tokens)


class _Failed(Exception):
    """The current worker's stream ended before the answer did; `reason` labels it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.passed: list[bytes] = []  # the whole events read before it, for the client


class MigratingRelay(Relay):
    """A streamed Relay that resumes on another worker when its worker fails mid-stream.

    Reads like a Relay to the front ends: `first` (empty: every byte goes through
    `read()`), then `read()` until b"". Only whole SSE events are passed on, so a
    resumed stream never splits one.
    """

    __slots__ = ("proxy", "pool", "req", "meta", "path", "block", "limit", "show_ids", "ids",
                 "tokenizer", "dialect", "pending", "buffer", "done", "finished", "id",
                 "created", "broken", "held", "exclude", "passed", "resuming", "skip",
                 "responses")

    def __init__(self, relay: Relay, proxy: Proxy, pool: Pool, req: ParsedRequest,
                 meta: RequestMeta, path: bytes, block: bytes, limit: int,
                 show_ids: bool, held: RequestBuffer | None = None,
                 exclude: tuple[str, ...] = ()) -> None:
        """`exclude`: workers the stream may never resume on (those without its LoRA
        adapter: a worker without it would answer 404, or its base model in its place)."""
        for name in Relay.__slots__:
            setattr(self, name, getattr(relay, name))
        self.proxy, self.pool, self.req, self.path, self.block = proxy, pool, req, path, block
        version = _header(relay.headers, VERSION_HEADER)  # a release's: resume on it
        self.meta = replace(meta, version=version) if version else meta
        self.limit = limit
        self.show_ids = show_ids  # the client asked for `token_ids` itself
        self.ids: list[int] = []  # token ids of the events passed on
        self.tokenizer = _header(relay.headers, _TOKENIZER)
        self.dialect = ANTHROPIC if req.kind == MESSAGES else \
            RESPONSES_API if req.kind == RESPONSES else OPENAI
        self.responses = ResponsesIds() if req.kind == RESPONSES else None
        self.headers = [(n, v) for n, v in relay.headers if n != _TOKENIZER]
        self.first, self.pending = b"", relay.first
        self.buffer = b""
        self.done = self.finished = False  # the end passed on / the last event before it
        self.id: Any = None  # the first worker's chunk `id` and `created` (OpenAI)
        self.created: Any = None
        self.broken: str | None = None  # why the stream could not go on (after its event)
        self.held = held  # where a resume that reached no worker waits for one (buffer.py)
        self.exclude = exclude
        self.passed = 0  # events passed on to the client
        self.resuming = False  # the current worker resumes what others began: rewrite
        self.skip = 0  # the current worker's first events, which the client has had

    @property
    def complete(self) -> bool:
        """The stream's end was passed on. False until then: the front ends read to b""."""
        return self.done

    async def read(self) -> bytes:
        """The next whole events (migrating as needed); b"" once the stream is over.
        Raises UpstreamError once a stream that could not migrate has sent its error
        event, so the front end drops the connection (the client sees a broken stream)."""
        if self.broken is not None:
            raise ReadError(self.broken)
        while not self.done:
            try:
                data = self._events(await self._read_upstream())
            except _Failed as failure:  # (the events before the failure go out first)
                data = b"".join(failure.passed) + await self._migrate(failure)
            if data:
                return data
        return b""

    async def _read_upstream(self) -> bytes:
        if self.pending:
            data, self.pending = self.pending, b""
            return data
        try:
            data = await self.upstream.read()
        except UpstreamError as exc:
            raise _Failed("read_error", f"{type(exc).__name__}: {exc}") from exc
        if not data:
            raise _Failed("closed", "the worker ended the stream before its end event")
        self.chunks += 1
        return data

    def _events(self, data: bytes) -> bytes:
        """Whole events of `buffer + data`, rewritten for the client; the rest kept.
        Raises _Failed for an error event (the worker failed mid-stream)."""
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        out: list[bytes] = []
        try:
            for event in events:
                if event.strip():
                    out.append(self._event(event))
        except _Failed as failure:
            failure.passed = out
            raise
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        """One event for the client. The first worker's events are read by pattern; a
        resuming worker's OpenAI chunks are re-encoded with the first one's `id` and
        `created`, a migrated Responses stream's events by `ResponsesIds`."""
        dialect = self.dialect
        if event.startswith(dialect.error):
            raise _Failed("error_event", event[:200].decode("utf-8", "replace"))
        if self.skip:
            self.skip -= 1
            return b""
        if event.startswith(dialect.done):
            self.done = True
            if self.responses is None:
                return event + b"\n\n"
        for found in _IDS_IN.findall(event):
            self.ids += [int(t) for t in found.split(b",") if t.strip()]
        self.finished |= dialect.finished is not None and dialect.finished in event
        self.passed += 1
        if self.responses is not None:
            return self.responses.rewritten(event, self.show_ids) if self.migrations else \
                self.responses.seen(event if self.show_ids else _TOKEN_IDS.sub(b"", event))
        if dialect.rewrite and self.resuming:
            return self._rewritten(event)
        if dialect.rewrite and self.id is None:
            chunk = _json(event)
            self.id, self.created = chunk.get("id"), chunk.get("created")
        return (event if self.show_ids else _TOKEN_IDS.sub(b"", event)) + b"\n\n"

    def _rewritten(self, event: bytes) -> bytes:
        chunk = _json(event)
        if not chunk:
            return event + b"\n\n"
        chunk["id"], chunk["created"] = self.id, self.created
        if not self.show_ids:
            for choice in chunk.get("choices", ()):
                choice.pop("token_ids", None)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    async def _migrate(self, failure: _Failed) -> bytes:
        """Switch to another worker that resumes the stream (b"": read on); when that
        cannot be (the limit, no worker, one that cannot resume), an error event."""
        endpoint = self.ticket.endpoint
        log.warning("stream from %s failed after %d tokens (%s: %s)", endpoint.url,
                    len(self.ids), failure.reason, failure)
        self.proxy.count_failure(self.pool, endpoint)
        self.upstream.close()
        endpoint.finish(self.ticket)
        self.buffer = b""
        if self.finished:  # only the usage chunk or the end event was missing: end it here
            self.done = True
            return self.dialect.end
        if not self.tokenizer:  # not a sluice worker: it cannot resume streams
            return self._give_up(f"the worker failed mid-stream ({failure.reason}) and "
                                 "does not return token ids to resume from")
        if self.migrations >= self.limit:
            return self._give_up(f"the worker failed mid-stream ({failure.reason}) and the "
                                 f"migration limit ({self.limit}) is reached")
        self.migrations += 1
        self.proxy.metrics.migrations.labels(failure.reason).inc()
        # (a stream that failed before any output goes again whole)
        self.resuming = self.passed > self.dialect.opening
        self.skip = 0 if self.resuming else self.passed
        block = self.block + _RESUME + b": " + ResumeIds(self.tokenizer, self.ids).encode() \
            + b"\r\n" if self.resuming else self.block
        try:
            relay = await self._resume(block, endpoint.url)
        except SluiceError as exc:
            return self._give_up(f"the worker failed mid-stream and no other could resume "
                                 f"it: {exc.message}")
        self.upstream, self.ticket, self.pending = relay.upstream, relay.ticket, relay.first
        if relay.status != 200:
            return await self._migrate(_Failed("resume_refused", relay.first[:200].decode(
                "utf-8", "replace")))
        return b""

    async def _resume(self, block: bytes, failed: str) -> Relay:
        """The resumed request's relay: on a worker of the stream's release version, or
        the baseline's when that version has none left. Where no worker is reached (a
        one-worker pool's worker died) it waits in the pool's buffer for the replacement."""
        exclude = (*self.exclude, failed)
        try:
            if self.held is not None:
                return await self.held.hold(self.pool, lambda: self.proxy.forward(
                    self.pool, self.req, self.meta, self.path, block, exclude=exclude),
                    NoWorkerReached)
            return await self.proxy.forward(self.pool, self.req, self.meta, self.path, block,
                                            exclude=exclude)
        except SluiceError:
            if self.meta.version == BASELINE:
                raise
            self.meta = replace(self.meta, version=BASELINE)
            return await self.proxy.forward(self.pool, self.req, self.meta, self.path, block,
                                            exclude=exclude)

    def _give_up(self, message: str) -> bytes:
        self.broken = message
        exc = SluiceError(message, code="migration_failed")
        if self.responses is not None:
            return self.responses.error(exc)
        return error_event(exc, self.path.decode("latin-1"))


class ResponsesIds:
    """A Responses stream as its client has seen it: the response's `id` and
    `created_at`, its output items' ids by `output_index` and the next
    `sequence_number`. The first worker's events pass as they are (only the events that
    name them are decoded); once it has migrated, every event is rewritten to go on with
    them (a resuming worker's replayed items sit at the same indices, under ids of its
    own; a stream sent again whole names its own response where the client saw none)."""

    __slots__ = ("id", "created_at", "items", "next")

    def __init__(self) -> None:
        self.id: Any = None
        self.created_at: Any = None
        self.items: dict[int, Any] = {}
        self.next = 0

    def seen(self, event: bytes) -> bytes:
        self.next += 1
        if event.startswith((b"event: response.created", b"event: response.output_item.added")):
            data = _json(event)
            if isinstance(response := data.get("response"), dict):
                self.id, self.created_at = response.get("id"), response.get("created_at")
            if isinstance(item := data.get("item"), dict):
                self.items[data.get("output_index", -1)] = item.get("id")
        return event + b"\n\n"

    def rewritten(self, event: bytes, show_ids: bool) -> bytes:
        data = _json(event)
        if not data:
            return event + b"\n\n"
        data["sequence_number"], self.next = self.next, self.next + 1
        index = data.get("output_index", -1)
        if "item_id" in data and index in self.items:
            data["item_id"] = self.items[index]
        if isinstance(item := data.get("item"), dict):
            item["id"] = self.items.setdefault(index, item.get("id"))
        if isinstance(response := data.get("response"), dict):
            if self.id is None:
                self.id, self.created_at = response.get("id"), response.get("created_at")
            response["id"], response["created_at"] = self.id, self.created_at
            for i, out in enumerate(response.get("output") or ()):
                if isinstance(out, dict) and i in self.items:
                    out["id"] = self.items[i]
        if not show_ids:
            data.pop("token_ids", None)
        return sse(data).encode()

    def error(self, exc: SluiceError) -> bytes:
        return responses_error_event(exc, self.next)


def _json(event: bytes) -> dict[str, Any]:
    """An event's JSON object ({} for anything else: passed on as it is)."""
    try:
        value = json.loads(event[event.index(b"{"):])
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    return next((v.decode("latin-1") for n, v in headers if n == name), None)
