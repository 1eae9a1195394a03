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
                 client sent (`Turn.patch`, applied by the meter).
    settlement   the final Response (completed, incomplete or failed) is saved with the
                 request's input items (ids given where the client sent none) before the
                 client has its last bytes, so the next turn finds it. A stream the
                 client left is not saved (it has no final Response).
    routes       GET /v1/responses/{id} (the Response), DELETE /v1/responses/{id}, GET
                 /v1/responses/{id}/input_items (the items that produced it: its whole
                 conversation, `limit` 1-100, `order` desc by default, `after` /
                 `before`), POST /v1/responses/{id}/cancel (a background response's).
    background   `"background": true`: answered `queued` at once (or, with `stream`,
                 its events as they come: `EventLog`) and run detached by the gateway
                 (middleware `Exchange.run_in_background`); GET polls it (or, with
                 `stream=true&starting_after=N`, follows it again), cancel stops it;
                 the final Response (or `failed` / `cancelled`) is kept as any other.
    replicas     a running background response names its replica (`owner`), which
                 renews its lease (`--background-lease`) while it runs, and keeps its
                 stream's events in the store every `FLUSH_S` (and at its end), so that
                 any replica can follow it, while it runs and after. A cancel on another
                 replica asks the owner through the store (it cancels at its next
                 renewal) and waits for the end. A response whose lease has lapsed
                 (`LEASE_S`: its replica was killed) is ended by whoever reads it next,
                 `failed` (`cancelled` when that read is a cancel), or else by another
                 replica's sweep (every lease, `sweep`), `failed`; whoever ends it writes
                 the ledger row its replica would have (`RunLedger`), under the run's
                 record id (its response's id), so that that row and the replica's own,
                 if it wrote one, land once.

`conversation` (OpenAI's Conversations API, gateway/conversations.py) is the other way
to carry state: the conversation's items go before the input, and the turn's input and
output items are appended to it once it is answered; each Response says
`"conversation": {"id"}`.

As OpenAI's API, the instructions and tools of a previous response are not carried
over. Responses are kept `--response-retention` days (30, OpenAI's); with 0 the gateway
keeps none, and the worker's answers (`store` must be false, `previous_response_id` a
400) stand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.gateway.conversations import Conversations, conversation_id_of, conversation_route
from sluice.gateway.items import db_call, input_items, only_params, page, query_params
from sluice.gateway.ledger import LedgerWriter
from sluice.gateway.meter import ResponseMeter
from sluice.gateway.pricing import PriceTable
from sluice.gateway.store import RunAdmission, Store, StoredResponse, UsageRecord
from sluice.gateway.tokens import CountPromptTokens
from sluice.protocol.errors import (
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    ServiceUnavailableError,
    SluiceError,
)
from sluice.protocol.openai import parse_request, reject_unsupported
from sluice.protocol.responses import (
    END_EVENTS,
    FAILED_EVENT,
    INPUT_TOKENS_PATH,
    PATH,
    UNSUPPORTED,
    ResponsesRequest,
    error_event,
    new_id,
    response,
    sse,
)

# The requests whose `previous_response_id` the gateway expands (the input-token count
# too: it counts what the request would send).
ENDPOINTS = (PATH, INPUT_TOKENS_PATH)
# A stored response's routes, by the path's shape (its id, then what of it).
_ROUTE = re.compile(r"^/v1/responses/(?P<id>[^/]+)(?P<rest>/input_items|/cancel)?$")
_END_STATUSES = ("completed", "incomplete", "failed")
RUNNING = ("queued", "in_progress")  # a background response's statuses before its end
_STORE_PATHS = (PATH + "/", "/v1/conversations")
MAX_CHAIN = 10_000  # responses in one conversation
RENEW_S = 1.0  # how often a replica renews its runs' lease and looks for cancels asked
LEASE_S = 15.0  # a run whose replica has not renewed it this long has lost its replica
# (`--background-lease`; renewed every RENEW_S, or a quarter of a shorter lease)
SWEEP_LIMIT = 20  # lapsed runs of other replicas one sweep ends (a sweep every lease)
CANCEL_POLL_S = 0.1  # how often a cancel asked of another replica looks for the end
FLUSH_S = 0.25  # how often a run's new events go to the store (and a follower reads them)
_STREAM_ENDS = tuple(f"event: {kind}" for kind in (*END_EVENTS, FAILED_EVENT))

logger = logging.getLogger(__name__)


def stored_route(path: str) -> str | None:
    """The route template of a stored response's path, or None."""
    match = _ROUTE.match(path)
    if match is None or match["id"] == "input_tokens":
        return None
    return PATH + "/{response_id}" + (match["rest"] or "")


class EventLog:
    """A background run's stream as its clients see it (the gateway's patches applied):
    its events in order, each with its `sequence_number`, kept while the run lives, so
    that its client, and any later `GET ...?stream=true&starting_after=N`, can follow it
    (the run does not wait for them)."""

    def __init__(self) -> None:
        self.events: list[tuple[int, bytes]] = []
        self.ended = False
        self.kept = 0  # the events the store has (`StoredResponses.keep_events`)
        self._more: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def add(self, chunk: bytes) -> None:
        """Take what the run sent: whole events (the meter cuts them)."""
        for event in re.split(rb"(?<=\n\n)", chunk):
            if event.strip():
                self.events.append((_sequence_number(event, len(self.events)), event))
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        if not self._more.done():
            self._more.set_result(None)
        self._more = asyncio.get_running_loop().create_future()

    async def follow(self, after: int | None = None) -> AsyncIterator[bytes]:
        """Its events after `after` (all without one), then each as it comes, until the
        run ends."""
        seen = 0
        while True:
            while seen < len(self.events):
                number, event = self.events[seen]
                seen += 1
                if after is None or number > after:
                    yield event
            if self.ended:
                return
            await asyncio.shield(self._more)


def failed_event(number: int, response: dict[str, Any]) -> bytes:
    """The `response.failed` event a background run's stream ends with when it fails."""
    return sse({"type": FAILED_EVENT, "sequence_number": number, "response": response}
               ).encode()


def _sequence_number(event: bytes, default: int) -> int:
    for line in event.splitlines():
        if line.startswith(b"data:"):
            with contextlib.suppress(ValueError, AttributeError):
                number = json.loads(line[5:]).get("sequence_number")
                if isinstance(number, int):
                    return number
    return default


@dataclass
class Run:
    """A background response this gateway runs."""

    tenant_id: str
    task: asyncio.Future[None]
    log: EventLog


@dataclass(frozen=True)
class RunLedger:
    """How a gateway writes the ledger row of a run it ends for a replica that is gone
    (`StoredResponses.end_lapsed`): through its ledger writer, priced with its prices,
    the output counted with its tokenizer."""

    writer: LedgerWriter
    prices: PriceTable
    count_tokens: CountPromptTokens


@dataclass
class Turn:
    """What admission decided for one Responses request."""

    store: bool  # keep its final Response
    previous_id: str | None
    input_items: list[Any] = field(default_factory=list)  # its own, ids given
    conversation_id: str | None = None  # its items go on in this conversation
    background_id: str | None = None  # `background`: the gateway runs it under this id
    streamed: bool = False  # a background one's client asked for its stream
    admission: RunAdmission | None = None  # a background one's, kept while it runs

    @property
    def record_id(self) -> str | None:
        """The ledger's record id for a background run's row: its response's id, so that
        the row its replica writes and the one written for it once that replica is gone
        are one row (the ledger keeps the first); None for any other request."""
        return self.background_id

    @property
    def patch(self) -> dict[str, Any]:
        """The fields every Response object passed on to the client gets."""
        fields: dict[str, Any] = {"store": True} if self.store else {}
        if self.background_id is not None:
            fields.update(id=self.background_id, background=True)
        if self.previous_id is not None:
            fields["previous_response_id"] = self.previous_id
        if self.conversation_id is not None:
            fields["conversation"] = {"id": self.conversation_id}
        return fields


def output_items(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A stored Response's output, as the input items of a later turn."""
    return [item for item in response.get("output") or [] if isinstance(item, dict)]


class StoredResponses:
    """The gateway's side of `store` (module docstring), on its `Store`."""

    def __init__(self, store: Store, retention_s: float, ledger: RunLedger,
                 lease_s: float = LEASE_S, on_lost: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.retention_s = retention_s
        self.ledger = ledger
        self.conversations = Conversations(store)
        self.running: dict[str, Run] = {}  # background responses this gateway runs
        self.stopping = False
        self.sweeping = False  # `start`ed: other replicas' lapsed runs are swept for good
        self.replica = uuid.uuid4().hex[:16]  # this gateway, as the `owner` of its runs
        self.lease_s = lease_s
        self.renew_s = min(RENEW_S, lease_s / 4)
        self.on_lost = on_lost  # a run whose replica is gone was ended here (a metric)
        self._renewing: asyncio.Task[None] | None = None
        self._sweep: asyncio.Future[int] | None = None
        self._finishing: set[asyncio.Future[Any]] = set()  # writes `stop` waits for

    def start(self) -> None:
        """At the gateway's start, on its loop: from now until `stop`, other replicas'
        lapsed runs are ended every lease (`sweep`), whether this gateway runs any or
        not."""
        self.sweeping = True
        self._tend()

    def add_run(self, response_id: str, run: Run) -> None:
        """A background response this gateway has begun to run: its lease is renewed
        and its events kept until it ends; then `end_run`."""
        self.running[response_id] = run
        self._tend()

    def end_run(self, response_id: str) -> None:
        """A run has ended: it leaves `running`, and the store gets its last events."""
        run = self.running.pop(response_id, None)
        if run is not None:
            self._finish(self.keep_events([(response_id, run.log)]))

    def _tend(self) -> None:
        """Make sure `_renew` runs (it ends once there is nothing left for it to do)."""
        if self._renewing is None or self._renewing.done():
            self._renewing = asyncio.ensure_future(self._renew())

    def _finish(self, work: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """`work` as a task of its own that `stop` waits for: a write that must land even
        if the caller that began it is cancelled."""
        task = asyncio.ensure_future(work)
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)
        return task

    async def _renew(self) -> None:
        """While this gateway runs background responses: keep their new events and renew
        their lease (`_renew_leases`); while it runs any, or once `start`ed: every lease,
        end other replicas' lapsed runs (`sweep`, a task of its own: a slow one does not
        hold this gateway's renewals back)."""
        renewed, swept = time.monotonic(), float("-inf")  # (the first tick sweeps)
        while self.running or self.sweeping:
            await asyncio.sleep(min(FLUSH_S, self.renew_s))
            await self.keep_events([(rid, run.log) for rid, run in self.running.items()])
            if self.running and time.monotonic() - renewed >= self.renew_s:
                renewed = time.monotonic()
                await self._renew_leases()
            if time.monotonic() - swept >= self.lease_s and (
                    self._sweep is None or self._sweep.done()):
                swept = time.monotonic()
                self._sweep = asyncio.ensure_future(self.sweep())
        self._renewing = None

    async def _renew_leases(self) -> None:
        """Renew the lease of this gateway's runs, and cancel those another replica was
        asked to cancel; a database error is logged (the runs go on; another try next
        time)."""
        try:
            asked = await db_call(self.store.renew_runs, self.replica,
                                  time.time() + self.lease_s)
        except SluiceError as exc:
            logger.warning("could not renew the background responses' lease: %s", exc)
            return
        for response_id in asked:
            if (run := self.running.get(response_id)) is not None:
                run.task.cancel()

    async def sweep(self) -> int:
        """End up to SWEEP_LIMIT of other replicas' runs whose lease has lapsed (their
        replica is gone), as a read of one ends it (`end_lapsed`: `failed`); how many
        this call ended. A database error is logged: the next sweep tries again."""
        ended = 0
        try:
            lapsed = await db_call(self.store.lapsed_runs, time.time(), SWEEP_LIMIT,
                                   self.replica)
            for stored in lapsed:
                ended += await self.end_lapsed(stored, "failed")
        except SluiceError as exc:
            logger.warning("could not end the background responses of gone replicas: %s",
                           exc)
        return ended

    async def keep_events(self, logs: list[tuple[str, EventLog]]) -> None:
        """Put the events of runs' streams that the store lacks in it, in one transaction
        (a database error is logged: they go with the next ones; one kept twice, by
        two calls at once, is skipped by the store)."""
        rows: list[tuple[str, int, str]] = []
        kept: list[tuple[EventLog, int]] = []
        for response_id, log in logs:
            rows += [(response_id, number, event.decode())
                     for number, event in log.events[log.kept:]]
            kept.append((log, len(log.events)))
        if not rows:
            return
        try:
            await db_call(self.store.add_response_events, rows,
                          time.time() + self.retention_s)
        except SluiceError as exc:
            logger.warning("could not keep the events of %d background responses: %s",
                           len(logs), exc)
            return
        for log, count in kept:
            log.kept = max(log.kept, count)

    async def stop(self) -> None:
        """At shutdown: stop sweeping, cancel the background runs (each is kept `failed`,
        saying so), and wait for their last events and the lapsed runs being ended."""
        self.stopping, self.sweeping = True, False
        if self._renewing is not None:
            self._renewing.cancel()
        if self._sweep is not None:
            self._sweep.cancel()
        tasks = [run.task for run in self.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._finishing, return_exceptions=True)

    @property
    def enabled(self) -> bool:
        return self.retention_s > 0

    async def queue(self, turn: Turn, payload: dict[str, Any], model: str | None,
                    tenant_id: str, key_id: str) -> dict[str, Any]:
        """The Response a `background` request is answered with at once (`queued`), kept
        so that GET finds it while it runs; a request the worker would refuse is its 400
        now, not a failed response later."""
        assert turn.background_id is not None
        body = reject_unsupported(payload, UNSUPPORTED)
        req = parse_request(ResponsesRequest, body)
        queued = response(req, turn.background_id, int(time.time()), status="in_progress",
                          model=model)
        queued.update(turn.patch, status="queued", usage=None)
        await self.keep(turn, queued, tenant_id, key_id)
        return queued

    async def keep(self, turn: Turn, response: dict[str, Any], tenant_id: str,
                   key_id: str) -> None:
        """Store `response` as the turn's (a background one's, whatever its status)."""
        created = response.get("created_at")
        at = float(created) if isinstance(created, (int, float)) else time.time()
        running = response.get("status") in RUNNING
        await db_call(self.store.save_response, StoredResponse(
            response["id"], tenant_id, key_id, turn.previous_id, turn.input_items, response,
            created_at=at, expires_at=at + self.retention_s,
            owner=self.replica if running else None,
            lease_until=time.time() + self.lease_s if running else None,
            admission=turn.admission if running else None))

    def route(self, path: str) -> str | None:
        """The route template of a path the gateway answers from its store (what the
        ledger records): a stored response's (unless it keeps none), a conversation's."""
        if not path.startswith(_STORE_PATHS):  # (every /v1/ request asks: no regex for most)
            return None
        if (found := conversation_route(path)) is not None:
            return found
        return stored_route(path) if self.enabled else None

    # -- admission ---------------------------------------------------------------------

    async def prepare(self, payload: dict[str, Any], tenant_id: str,
                      endpoint: str) -> Turn | None:
        """Put the earlier turns (`previous_response_id`'s chain, or the `conversation`'s
        items) before `payload["input"]` and send `store` false (module docstring); None
        when the request needs nothing of the store (`store` false and no earlier turns;
        or a store of 0 days without a conversation, where the worker answers `store`
        itself)."""
        previous = payload.get("previous_response_id")
        conversation = payload.get("conversation")
        asked = payload.get("store", True) if endpoint == PATH else False
        background = payload.get("background") if endpoint == PATH else None
        if background not in (None, True, False):
            raise InvalidRequestError("'background' must be a boolean", param="background")
        if background and (not self.enabled or asked is False):
            raise InvalidRequestError("'background' needs a stored response ('store' true, "
                                      "and a gateway that keeps them): its result is read "
                                      "with GET /v1/responses/{id}", param="background")
        if previous is not None and not isinstance(previous, str):
            raise InvalidRequestError("'previous_response_id' must be a string",
                                      param="previous_response_id")
        if previous is not None and conversation is not None:
            raise InvalidRequestError("'previous_response_id' and 'conversation' cannot be "
                                      "used together: a turn continues one of them",
                                      param="conversation")
        if not self.enabled:
            if previous is not None:
                raise InvalidRequestError(
                    "previous_response_id: this gateway keeps no responses "
                    "(--response-retention 0); send the whole conversation as 'input'",
                    param="previous_response_id")
            if conversation is None:
                return None
            if payload.get("store") is True:
                raise InvalidRequestError("'store': true is not supported: this gateway "
                                          "keeps no responses (--response-retention 0)",
                                          param="store")
            if asked is True or asked is None:  # (the default: only the conversation
                asked = False  # keeps the turn)
        if asked not in (True, False, None):
            raise InvalidRequestError("'store' must be a boolean", param="store")
        if asked is False and previous is None and conversation is None:
            return None  # the request goes as it came, and nothing is kept
        turn = Turn(store=asked is not False, previous_id=previous,
                    input_items=input_items(payload.get("input")))
        if "background" in payload:
            if payload.pop("background"):
                turn.background_id = new_id("resp")
                turn.streamed = payload.get("stream") is True
                payload["stream"] = True  # (to the gateway: a cancelled run's tokens count)
        if previous is not None or conversation is not None:
            if not isinstance(turn.input_items, list):
                raise InvalidRequestError("'input' must be a string or a list of input items",
                                          param="input")
            if previous is not None:
                earlier = await db_call(self.history, previous, tenant_id)
                del payload["previous_response_id"]
            else:
                turn.conversation_id = conversation_id_of(conversation)
                earlier = await self.conversations.items(turn.conversation_id, tenant_id)
                del payload["conversation"]
            payload["input"] = earlier + turn.input_items
        if turn.store:
            payload["store"] = False
        return turn

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

    async def save(self, turn: Turn, response: dict[str, Any], tenant_id: str,
                   key_id: str) -> None:
        """Keep a final Response (not one still in progress), and append the turn to its
        conversation (when it was answered: completed, or cut at max_output_tokens)."""
        status = response.get("status")
        if turn.conversation_id is not None and status in ("completed", "incomplete"):
            await self.conversations.append(turn.conversation_id, tenant_id,
                                            turn.input_items + output_items(response))
        if not turn.store or status not in _END_STATUSES \
                or not isinstance(response.get("id"), str):
            return
        await self.keep(turn, response, tenant_id, key_id)

    # -- the routes --------------------------------------------------------------------

    async def answer(self, method: str, path: str, query: bytes, body: bytes,
                     tenant_id: str) -> dict[str, Any] | AsyncIterator[bytes]:
        """A stored response's route (module docstring), or a conversation's
        (conversations.py): the JSON to answer 200 with, or a `SluiceError` (404 for an
        id this tenant has nothing under)."""
        if conversation_route(path) is not None:
            return await self.conversations.answer(method, path, query, body, tenant_id)
        match = _ROUTE.match(path)
        assert match is not None
        response_id, rest = match["id"], match["rest"] or ""
        params = query_params(query)
        action = (method, rest)
        if action == ("GET", ""):
            only_params(params, {"stream": ("false", "true"), "starting_after": None,
                                 "include_obfuscation": ("false",)})
            if params.get("stream") == "true":
                return await self._follow(response_id, tenant_id, params.get("starting_after"))
            return (await self._find(response_id, tenant_id)).response
        if action == ("DELETE", ""):
            only_params(params, {})
            if not await db_call(self.store.delete_response, response_id, tenant_id):
                raise _not_found(response_id)
            return {"id": response_id, "object": "response.deleted", "deleted": True}
        if action == ("GET", "/input_items"):
            return await self._input_items(response_id, tenant_id, params)
        if action == ("POST", "/cancel"):
            only_params(params, {})
            return await self._cancel(response_id, tenant_id)
        raise MethodNotAllowedError(f"{method} is not allowed on {PATH}/{{response_id}}{rest}")

    async def _cancel(self, response_id: str, tenant_id: str) -> dict[str, Any]:
        """Cancel a background response (its run ends as a client that hung up: the
        worker stops, the ledger records it `aborted`) and answer it, now `cancelled`;
        one that has ended is answered as it is (cancelling is idempotent). Another
        replica's run is asked through the store, and waited for."""
        run = self.running.get(response_id)
        if run is not None and run.tenant_id == tenant_id:
            run.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(run.task)
        stored = await self._find(response_id, tenant_id, lapsed="cancelled")
        if not stored.response.get("background"):
            raise InvalidRequestError("Only responses created with 'background': true can "
                                      "be cancelled; this one ran in the foreground and has "
                                      "ended", param="response_id")
        deadline = time.monotonic() + 2 * self.lease_s  # (its lease lapses before)
        while stored.response.get("status") in RUNNING and time.monotonic() < deadline:
            # asked again each time: the owner's `in_progress` may have replaced the ask
            await db_call(self.store.ask_cancel, response_id, tenant_id)
            await asyncio.sleep(CANCEL_POLL_S)
            stored = await self._find(response_id, tenant_id, lapsed="cancelled")
        if stored.response.get("status") in RUNNING:
            raise ServiceUnavailableError("the gateway replica running this background "
                                          "response did not cancel it in time; retry",
                                          code="cancel_timeout")
        return stored.response

    async def _follow(self, response_id: str, tenant_id: str,
                      after: str | None) -> AsyncIterator[bytes]:
        """A background response's stream, after event `after` (OpenAI's
        `starting_after`): a client that lost it takes it up again, on any replica,
        while it runs or after. The replica that runs it answers from its run's events
        as they come; another, or any once it has ended, from the store."""
        if after is not None and not after.lstrip("-").isdigit():
            raise InvalidRequestError("'starting_after' must be an event's sequence number",
                                      param="starting_after")
        start = None if after is None else int(after)
        run = self.running.get(response_id)
        if run is not None and run.tenant_id == tenant_id:
            return run.log.follow(start)
        stored = await self._find(response_id, tenant_id)
        if not stored.response.get("background"):
            raise InvalidRequestError("only a background response's stream is kept; this "
                                      "one ran in the foreground: GET it without stream",
                                      param="stream")
        return self._kept_stream(response_id, tenant_id, -1 if start is None else start)

    async def _kept_stream(self, response_id: str, tenant_id: str,
                           after: int) -> AsyncIterator[bytes]:
        """A background response's stream as the store keeps it, from event `after` + 1:
        read every FLUSH_S while it runs, to its end event (or, for a run cancelled or
        lost, a few reads past its end, for the last events its replica keeps)."""
        quiet = 0
        while quiet < 3:
            try:
                events = await db_call(self.store.response_events, response_id, after, 500)
                ended = len(events) < 500 and (await self._find(
                    response_id, tenant_id)).response.get("status") not in RUNNING
            except SluiceError as exc:  # (the client takes it up again later)
                yield error_event(exc, after + 1)
                return
            for number, event in events:
                after = number
                yield event.encode()
                if event.startswith(_STREAM_ENDS):
                    return
            if len(events) == 500:
                continue
            quiet = quiet + 1 if ended and not events else 0
            await asyncio.sleep(FLUSH_S)

    async def _find(self, response_id: str, tenant_id: str,
                    lapsed: str = "failed") -> StoredResponse:
        """The tenant's stored response; a running one whose lease has lapsed (its
        replica is gone) is ended first, `lapsed` (module docstring)."""
        for _ in range(5):  # (bounded: a lease renewed meanwhile is read again)
            stored = await db_call(self.store.get_response, response_id, tenant_id)
            if stored is None:
                raise _not_found(response_id)
            if stored.response.get("status") not in RUNNING or \
                    (stored.lease_until or 0.0) >= time.time():
                return stored
            await self.end_lapsed(stored, lapsed)  # (or another did: read it again)
        raise ServiceUnavailableError(f"response {response_id!r} changed as it was read; "
                                      "retry", code="response_store_unavailable")

    async def end_lapsed(self, stored: StoredResponse, lapsed: str) -> bool:
        """End a running response whose lease has lapsed (its replica is gone), as it was
        read (`stored`): kept `lapsed` (`failed`, saying why; or `cancelled`), counted
        (`on_lost`), its ledger row written for its replica (`lapsed_record`) and its
        kept stream ended with `response.failed`; False (nothing done) if its replica
        renewed or ended it, or another gateway ended it, meanwhile (the store's
        compare-and-set). Runs to its end even if the caller is cancelled."""
        return bool(await asyncio.shield(self._finish(self._end_lapsed(stored, lapsed))))

    async def _end_lapsed(self, stored: StoredResponse, lapsed: str) -> bool:
        ended = {**stored.response, "status": lapsed, "error": None if
                 lapsed == "cancelled" else {
                     "code": "server_error", "message": "the gateway replica that ran "
                     "this background response stopped before it ended"}}
        if not await db_call(self.store.end_orphan, stored, ended):
            return False
        logger.warning("background response %s lost its gateway replica (%s): kept %s",
                       stored.id, stored.owner, lapsed)
        self.on_lost()
        if stored.admission is not None:  # (none kept by an older sluice: no row here,
            # since its replica's own row had a record id of its own)
            await self.ledger.writer.write(await self.lapsed_record(stored, lapsed),
                                           stored.admission.reservation)
        if lapsed == "failed":  # its kept stream ends as its replica would end it
            number = await db_call(self.store.last_response_event, stored.id) + 1
            await db_call(self.store.add_response_events, [
                (stored.id, number, failed_event(number, ended).decode())], stored.expires_at)
        return True

    async def lapsed_record(self, stored: StoredResponse, lapsed: str) -> UsageRecord:
        """The ledger row a lapsed run's replica would have written, under the run's
        record id (`Turn.record_id`): its prompt tokens as counted at admission, its
        output tokens as its kept stream shows them (text deltas counted with this
        gateway's tokenizer, as a stream cut short is counted; none if the store cannot
        read them now), `error` (or `aborted`, when a cancel ended it)."""
        assert stored.admission is not None
        meter = ResponseMeter(protocol="responses", streaming=True)
        try:
            await self._read_kept(stored.id, meter)
        except SluiceError as exc:
            logger.warning("background response %s: its kept stream could not be read "
                           "(%s); its ledger row counts no output tokens", stored.id, exc)
        kept_model = stored.response.get("model")
        model = meter.served_model or (kept_model if isinstance(kept_model, str) else None)
        prompt = stored.admission.prompt_tokens if meter.prompt_tokens is None \
            else meter.prompt_tokens
        completion = meter.completion_tokens
        if completion is None:
            text = meter.text
            completion = await asyncio.to_thread(
                self.ledger.count_tokens, model, {"prompt": text}) if text else 0
        return UsageRecord(
            request_id=stored.admission.request_id, tenant_id=stored.tenant_id,
            key_id=stored.key_id, endpoint=PATH, model=model,
            status="aborted" if lapsed == "cancelled" else "error",
            http_status=200 if stored.response.get("status") == "in_progress" else 499,
            prompt_tokens=prompt, completion_tokens=completion,
            cost_usd=self.ledger.prices.cost(model, prompt, completion),
            latency_ms=(time.time() - stored.created_at) * 1000, record_id=stored.id)

    async def _read_kept(self, response_id: str, meter: ResponseMeter) -> None:
        """Feed a response's kept stream, all of it, to `meter`."""
        after = -1
        while events := await db_call(self.store.response_events, response_id, after, 500):
            for _, event in events:
                meter.feed(event.encode())
            if len(events) < 500:
                return
            after = events[-1][0]

    async def _input_items(self, response_id: str, tenant_id: str,
                           params: dict[str, str]) -> dict[str, Any]:
        only_params(params, {"limit": None, "order": ("asc", "desc"), "after": None,
                             "before": None, "include": ("",)})
        stored = await self._find(response_id, tenant_id)
        items = stored.input_items
        if stored.previous_id is not None:
            items = await db_call(self.history, stored.previous_id, tenant_id) + items
        return page(items, params)


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id {response_id!r} not found.", param="response_id",
                         code="response_not_found")
