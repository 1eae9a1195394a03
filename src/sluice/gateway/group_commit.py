"""Group commit: items that arrive while a database commit runs share the next one.

One transaction per request would cap a gateway at the database's commit rate, so the
ledger (`LedgerWriter`) and budget reservations (`BudgetReservations`) queue their
writes here: `submit` appends an item and returns a future; a drain task, independent of
the callers, commits whatever has queued (up to `max_batch` at a time, in a thread) and
resolves each item's future with its result, or with the commit's exception. At low load
a batch is one item; under load many requests share one commit. A caller cancelled while
waiting does not stop its item from being committed.

`spacing_s` (0: none) spaces the commits: a batch starts at least that long after the
previous one began, unless an `urgent` item waits (a caller awaiting it on a request's
path). Under load each commit then carries more items and the commit thread wakes less
often: every wake-up is a round of GIL hand-offs with the event loop, which delayed the
requests it served (the ledger's rows, written after their responses: docs/gateway.md).
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

    def __init__(self, commit: Callable[[list[Item]], list[Result]], max_batch: int = 256,
                 spacing_s: float = 0.0):
        self.commit = commit
        self.max_batch = max_batch
        self.spacing_s = spacing_s
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._urgent = 0  # pending items a caller awaits on a request's path
        self._wake: asyncio.Future[None] | None = None  # ends a spacing wait early
        self._last_start = float("-inf")
        self._drain: asyncio.Task[None] | None = None

    def submit(self, item: Item, *, urgent: bool = True) -> asyncio.Future[Result]:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if urgent:
            self._urgent += 1
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run())
        return future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            wait = self._last_start + self.spacing_s - loop.time()
            if wait > 0 and not self._urgent:
                self._wake = loop.create_future()
                await asyncio.wait([self._wake], timeout=wait)
                self._wake = None
            self._last_start = loop.time()
            batch, self._pending = (self._pending[: self.max_batch],
                                    self._pending[self.max_batch:])
            if not self._pending:  # (past max_batch the count stays: no wait for the rest)
                self._urgent = 0
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
