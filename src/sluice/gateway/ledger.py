"""Durable usage records with group commit, kept and retried while the database is down.

Every request's `UsageRecord` must be written (ledger row + tenant spend, one
transaction) before its last bytes reach the client, so that the next request of the
same tenant sees the new spend. One transaction per request would cap throughput at the
database's commit rate, so `LedgerWriter` batches (`group_commit.GroupCommit`): records
that arrive while a commit is in progress are written together in the next transaction
(`Store.record_usage_many`), and each caller waits for the commit that contains its
record. At low load a batch is one record; under load many requests share one commit.
The drain task is independent of the callers, so a caller cancelled while waiting
(client gone, server shutting down) still gets its record written.

A record also carries the budget reservation its request made at admission (its id);
the commit that writes the record gives the reservation back, so a request's cost
moves from "reserved" to "spent" in one step.

When the database cannot be reached (`ServiceUnavailableError` from the store), the
batch is kept in memory, `waiting`, and a retry task writes it again, oldest first,
backing off from 50 ms to 2 s, until the store answers; records that arrive meanwhile
join the queue behind it. The caller is not held: it returns once its record is
committed or waiting. A retry after a commit whose reply was lost cannot count a record
twice (the store's insert is idempotent on `record_id`). The buffer holds at most
`max_waiting` records: while it is full the gateway refuses new requests (503
`ledger_full`), and a record that still arrives (its request was admitted before) is
dropped.
A record the store refuses for itself (not an outage) is written alone, so it does not
take its batch down, and dropped if refused again. Every dropped record is logged with
its request id and counted in `sluice_gateway_ledger_errors_total`; `close` waits a
bounded time at shutdown for the waiting ones and counts what is left as dropped.

With a `spool` (`spool.py`; `sluice serve` and `sluice gateway` keep one under
SLUICE_HOME) every waiting record is also in a local file until the database has it:
`close` then leaves what still waits there instead of dropping it, and `recover` (at
the next start on the same database) writes it, so a gateway killed or stopped during
an outage loses no record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from sluice.gateway.group_commit import GroupCommit
from sluice.gateway.metrics import GatewayMetrics
from sluice.gateway.spool import Item, LedgerSpool
from sluice.gateway.store import Store, UsageRecord
from sluice.protocol.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)


class LedgerWriter:
    """Owns the records not yet committed; one per GatewayState and event loop."""

    def __init__(self, store: Store, metrics: GatewayMetrics | None = None, *,
                 max_batch: int = 256, max_waiting: int = 10_000,
                 retry_s: tuple[float, float] = (0.05, 2.0),
                 spool: LedgerSpool | None = None, batch_interval_s: float = 0.0) -> None:
        self.store = store
        self.spool = spool
        self.metrics = metrics or GatewayMetrics()
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self.first_retry_s, self.max_retry_s = retry_s
        self.waiting: list[Item] = []  # not written because the store was down; oldest first
        self._queue: GroupCommit[Item, Exception | None] = GroupCommit(
            self._commit, max_batch, spacing_s=batch_interval_s)  # (`write`s go at once)
        self._retry: asyncio.Task[None] | None = None

    @property
    def full(self) -> bool:
        return len(self.waiting) >= self.max_waiting

    async def write(self, record: UsageRecord, reservation: str | None = None) -> None:
        """Return once `record` is committed (and `reservation`, if any, given back) or
        kept in `waiting`; a record dropped instead is logged and counted, not raised.
        Cancelled, it is written all the same."""
        await asyncio.wait([self.submit(record, reservation, urgent=True)])

    def submit(self, record: UsageRecord, reservation: str | None = None, *,
               urgent: bool = False) -> asyncio.Future[Exception | None]:
        """`write` without waiting: the future is done when `write` would return. Not
        `urgent` (nobody awaits it on a request's path): committed with the next batch,
        at most `batch_interval_s` after the previous one began."""
        item = (record, reservation)
        if self.waiting:  # the store is down: queue behind the records already waiting
            self._keep([item])
            kept: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
            kept.set_result(None)
            return kept
        future = self._queue.submit(item, urgent=urgent)
        future.add_done_callback(lambda done: self._after(item, done))
        return future

    def _after(self, item: Item, done: asyncio.Future[Exception | None]) -> None:
        error = done.exception() or done.result()
        if error is not None:
            self._keep(self._sort([item], [error]))

    def recover(self) -> None:
        """Take up the records a previous gateway on this database left in the spool
        (killed, or stopped while the database was down): they wait, oldest first, ahead
        of any new one, and are written once the store answers. Call once, at start."""
        left = self.spool.load() if self.spool is not None else []
        if not left:
            return
        assert self.spool is not None
        logger.warning("%d usage records left in %s by an earlier gateway: writing them",
                       len(left), self.spool.path)
        self.waiting[:0] = left
        self._keep([])

    async def close(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the waiting records to be written, then stop
        retrying; those still waiting stay in the spool for the next start, or without
        one are logged and counted as dropped."""
        if self._retry is not None:
            await asyncio.wait([self._retry], timeout=timeout_s)
            self._retry.cancel()
        if self.waiting and self.spool is not None:
            logger.error("%d usage records not written yet: the database was still "
                         "unreachable at shutdown (waited %.0f s); kept in %s for the next "
                         "start", len(self.waiting), timeout_s, self.spool.path)
        elif self.waiting:
            logger.error("%d usage records not written: the database was still unreachable "
                         "at shutdown (waited %.0f s)", len(self.waiting), timeout_s)
            self.metrics.ledger_errors.inc(len(self.waiting))
        self.waiting.clear()
        self.metrics.ledger_waiting.set(0)
        if self.spool is not None:
            self.spool.close()

    def _commit(self, batch: list[Item]) -> list[Exception | None]:
        """Write `batch` in one transaction (in a worker thread); per item, None or the
        error. A batch the store refuses (not an outage) is written again one record at
        a time, so one record it cannot take does not take the others with it."""
        try:
            self.store.record_usage_many([record for record, _ in batch],
                                         [rid for _, rid in batch if rid is not None])
        except Exception as exc:
            if len(batch) == 1 or isinstance(exc, ServiceUnavailableError):
                return [exc] * len(batch)
            return [self._commit([item])[0] for item in batch]
        return [None] * len(batch)

    def _commit_and_unspool(self, batch: list[Item]) -> list[Exception | None]:
        """`_commit`, then the spool forgets the records that are no longer waiting
        (written, or refused for good)."""
        errors = self._commit(batch)
        if self.spool is not None:
            self.spool.remove(r.record_id for (r, _), e in zip(batch, errors, strict=True)
                              if not isinstance(e, ServiceUnavailableError))
        return errors

    def _sort(self, batch: list[Item], errors: Sequence[BaseException | None]) -> list[Item]:
        """The items to retry (the store was down); refused ones are dropped."""
        retry = []
        for item, error in zip(batch, errors, strict=True):
            if isinstance(error, ServiceUnavailableError):
                retry.append(item)
            elif error is not None:
                self._drop(item, f"the store refused it: {error!r}")
        return retry

    def _keep(self, items: list[Item]) -> None:
        """Append `items` to `waiting` and the spool (beyond `max_waiting`: drop them)
        and make sure the retry task runs."""
        kept = []
        for item in items:
            if self.full:
                self._drop(item, f"{self.max_waiting} records already wait for the database")
            else:
                self.waiting.append(item)
                kept.append(item)
        if self.spool is not None and kept:
            self.spool.add(kept)  # a local file: ~30 us a record, and only during an outage
        self.metrics.ledger_waiting.set(len(self.waiting))
        if self.waiting and (self._retry is None or self._retry.done()):
            logger.warning("gateway database unreachable: usage records kept and retried")
            self._retry = asyncio.create_task(self._write_waiting())

    async def _write_waiting(self) -> None:
        """Write `waiting`, oldest first, until it is empty; the pause between tries
        doubles (up to `max_retry_s`) while the store stays down."""
        delay, written, started = self.first_retry_s, 0, time.monotonic()
        while self.waiting:
            await asyncio.sleep(delay)
            batch = self.waiting[: self.max_batch]
            errors = await asyncio.to_thread(self._commit_and_unspool, batch)
            del self.waiting[: len(batch)]  # only appended to meanwhile
            retry = self._sort(batch, errors)
            self.waiting[:0] = retry
            self.metrics.ledger_waiting.set(len(self.waiting))
            written += errors.count(None)
            delay = min(max(2 * delay, self.first_retry_s), self.max_retry_s) if retry else 0.0
        logger.warning("gateway database reachable again: %d waiting usage records written "
                       "after %.1f s", written, time.monotonic() - started)

    def _drop(self, item: Item, why: str) -> None:
        self.metrics.ledger_errors.inc()
        logger.error("usage record for request %s not written: %s", item[0].request_id, why)
