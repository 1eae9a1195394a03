"""Durable usage records with group commit.

Every request's `UsageRecord` must be written (ledger row + tenant spend, one
transaction) before its last bytes reach the client, so that the next request of the
same tenant sees the new spend. One transaction per request would cap throughput at the
database's commit rate, so `LedgerWriter` batches (`group_commit.GroupCommit`): records
that arrive while a commit is in progress are written together in the next transaction
(`Store.record_usage_many`), and each caller waits for the commit that contains its record. At low load a batch is
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

from sluice.gateway.group_commit import GroupCommit
from sluice.gateway.store import Store, UsageRecord

logger = logging.getLogger(__name__)


class LedgerWriter:
    """Owns the queue of records not yet committed; one per GatewayState and event loop."""

    def __init__(self, store: Store, max_batch: int = 256) -> None:
        self.store = store
        self._queue: GroupCommit[tuple[UsageRecord, str | None], None] = GroupCommit(
            self._commit, max_batch)

    async def write(self, record: UsageRecord, reservation: str | None = None) -> None:
        """Return once `record` is committed (and `reservation`, if any, given back);
        raise what the store raised otherwise."""
        await asyncio.shield(self._queue.submit((record, reservation)))

    def _commit(self, batch: list[tuple[UsageRecord, str | None]]) -> list[None]:
        released = [rid for _, rid in batch if rid is not None]
        self.store.record_usage_many([record for record, _ in batch], released)
        return [None] * len(batch)
