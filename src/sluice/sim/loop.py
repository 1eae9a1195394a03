"""Virtual time: a discrete-event loop (a heap of timed callbacks).

Nothing in the simulator sleeps or reads a wall clock: every component is handed
`loop.now` (the production router's `Pool` and `BlockIndex` take it as their `clock`)
and schedules what happens next with `loop.at`. Events at the same instant run in the
order they were scheduled (a counter breaks ties), so a run is a pure function of its
inputs and seeds.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any


class EventLoop:
    """Owns the clock and the pending events. Not thread-safe (one simulation, one thread)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events_run = 0
        self._heap: list[tuple[float, int, Callable[..., None], Any]] = []
        # the last event `after` scheduled, held out of the heap: `run` takes the earlier of
        # it and the heap's first with one `heappushpop` (one comparison when it is the
        # earlier, as a worker's next step often is) instead of a push and a pop
        self._next: tuple[float, int, Callable[..., None], Any] | None = None
        self._order = itertools.count()

    def clock(self) -> float:
        """The current virtual time in seconds (pass this where a `time.monotonic` goes)."""
        return self.now

    def at(self, when: float, fn: Callable[..., None], arg: Any = None) -> None:
        """Run `fn(arg)` (or `fn()` when `arg` is None) at virtual time `when` (>= now)."""
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), fn, arg))

    def after(self, delay: float, fn: Callable[..., None], arg: Any = None) -> None:
        """`at(now + delay)` (a negative delay is now), without the extra call."""
        when = self.now + delay if delay > 0 else self.now
        if self._next is None:
            self._next = (when, next(self._order), fn, arg)
        else:
            heapq.heappush(self._heap, (when, next(self._order), fn, arg))

    def at_each(self, fn: Callable[[Any], None], timed: Iterable[tuple[float, Any]]) -> None:
        """`at(when, fn, arg)` for each `(when, arg)` of `timed`, in that order: the same
        run, event for event (each keeps the tie-break it would have had), but the heap
        holds one of them at a time. A trace's thousands of arrivals, all scheduled up
        front, would otherwise deepen every other event's push and pop."""
        now = self.now
        items = [(max(when, now), arg) for when, arg in timed]
        base = next(self._order)  # the tie-breaks base .. base + len(items) - 1
        self._order = itertools.count(base + len(items))
        queue = iter(sorted(range(len(items)), key=lambda i: items[i][0]))  # stable
        heap = self._heap

        def push_next() -> None:
            i = next(queue, None)
            if i is not None:
                heapq.heappush(heap, (items[i][0], base + i, run_one, i))

        def run_one(i: int) -> None:
            push_next()  # the next one in time order, before anything this one schedules
            fn(items[i][1])

        push_next()

    def run(self, until: float | None = None) -> None:
        """Run events in time order until none is left (or the next is after `until`)."""
        heap, pop, pushpop = self._heap, heapq.heappop, heapq.heappushpop
        end = math.inf if until is None else until
        count = 0
        try:
            while True:
                item = self._next
                if item is not None:  # the earlier of it and the heap's first
                    self._next = None
                    if heap:
                        item = pushpop(heap, item)
                elif heap:
                    item = pop(heap)
                else:
                    return
                if item[0] > end:
                    heapq.heappush(heap, item)  # not yet: it stays pending
                    self.now = end
                    return
                self.now, _, fn, arg = item
                count += 1
                if arg is None:
                    fn()
                else:
                    fn(arg)
        finally:
            self.events_run += count

    def __len__(self) -> int:
        return len(self._heap) + (self._next is not None)
