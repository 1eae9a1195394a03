"""Durable usage records with group commit.

Every request's `UsageRecord` must be written (ledger row + tenant spend, one
transaction) before its last bytes reach the client, so that the next request of the
same tenant sees the new spend. One transaction per request would cap throughput at the
database's commit rate, so `LedgerWriter` batches: records that arrive while a commit
is in progress are written together in the next transaction (`Store.record_usage_many`),
and each caller waits for the commit that contains its record. At low load a batch is
one record; under load many requests share one commit. The drain task is independent of
the callers, so a caller cancelled while waiting (client gone, server shutting down)
still gets its record written.

A record also carries the budget reservation its request made at admission (its id);
the commit that writes the record gives the reservation back, so a request's cost
moves from "reserved" to "spent" in one step.
"""

from __future__ import annotations

import asyncio
import logging

from sluice.gateway.store import Store, UsageRecord

logger = logging.getLogger(__name__)


class LedgerWriter:
    """Owns the queue of records not yet committed; one per GatewayState and event loop."""

    def __init__(self, store: Store, max_batch: int = 256) -> None:
        self.store = store
        self.max_batch = max_batch
        self._pending: list[tuple[UsageRecord, str | None, asyncio.Future[None]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def write(self, record: UsageRecord, reservation: str | None = None) -> None:
        """Return once `record` is committed (and `reservation`, if any, given back);
        raise what the store raised otherwise."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((record, reservation, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run())
        await asyncio.shield(future)

    async def _run(self) -> None:
        while self._pending:
            batch, self._pending = (self._pending[: self.max_batch],
                                    self._pending[self.max_batch:])
            released = [rid for _, rid, _ in batch if rid is not None]
            try:
                await asyncio.to_thread(self.store.record_usage_many,
                                        [r for r, _, _ in batch], released)
            except Exception as exc:
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for _, _, future in batch:
                if not future.done():
                    future.set_result(None)
