"""Group commit: items that arrive while a database commit runs share the next one.

One transaction per request would cap a gateway at the database's commit rate, so the
ledger (`LedgerWriter`) and budget reservations (`BudgetReservations`) queue their
writes here: `submit` appends an item and returns a future; a drain task, independent of
the callers, commits whatever has queued (up to `max_batch` at a time, in a thread) and
resolves each item's future with its result, or with the commit's exception. At low load
a batch is one item; under load many requests share one commit. A caller cancelled while
waiting does not stop its item from being committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class GroupCommit(Generic[Item, Result]):
    """`commit(items) -> results` (one per item, in order) runs in a worker thread; one
    instance per event loop."""

    def __init__(self, commit: Callable[[list[Item]], list[Result]], max_batch: int = 256):
        self.commit = commit
        self.max_batch = max_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._drain: asyncio.Task[None] | None = None

    def submit(self, item: Item) -> asyncio.Future[Result]:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run())
        return future

    async def _run(self) -> None:
        while self._pending:
            batch, self._pending = (self._pending[: self.max_batch],
                                    self._pending[self.max_batch:])
            try:
                results = await asyncio.to_thread(self.commit, [item for item, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
