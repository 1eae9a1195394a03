"""The P:D ratio of a disaggregated pool: per-side load -> planner -> a live role switch.

    every step of the pool's Controller (controller.py):
      pd_signals (signals.py)      prefill queue and busy, decode running / waiting / KV
      PDRatioPlanner.decide        move a worker to the side over its target, when the
                                   other side holds its own with one fewer, once wanted
                                   for the delay (planner.py)
      switch                       the donor side's worker with the least in flight:
                                   RoleTable.switch (router/pd.py) -- the router stops
                                   sending it requests, its requests finish, then POST
                                   /v1/pd_role {role, expected_epoch: the one read,
                                   drain_timeout}; 409 (someone switched it first): the
                                   role is read again and the next step decides anew

The worker count is the Controller's (its planner's); this only divides it between the
sides, and tells the Controller which role a new worker should start with (`next_role`:
the side further below its share, so a replaced worker keeps the ratio).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from sluice.control.planner import PDMove, PDRatioPlanner
from sluice.control.signals import pd_signals
from sluice.protocol.errors import SluiceError
from sluice.router.config import DECODE, PREFILL
from sluice.router.endpoints import Endpoint
from sluice.router.pool import Pool
from sluice.router.state import RouterState

log = logging.getLogger(__name__)


class PDController:
    """Divides one pool's workers between prefill and decode; owns its pending switch."""

    def __init__(self, name: str, state: RouterState, pool: Pool, planner: PDRatioPlanner,
                 prefill_share: float, drain_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`prefill_share`: the prefill side's share of new workers (1:3 -> 0.25)."""
        self.name, self.state, self.pool, self.planner = name, state, pool, planner
        self.prefill_share = prefill_share
        self.drain_timeout_s = drain_timeout_s
        self.clock = clock
        self.last: PDMove | None = None
        self.switching: asyncio.Task[None] | None = None
        self.starting: list[str] = []  # roles of workers being started

    def next_role(self) -> str:
        """The role a newly started worker gets: the side below its share of the pool."""
        counts = self.state.pd.roles.count(self.pool)
        prefill = counts[PREFILL] + self.starting.count(PREFILL)
        total = sum(counts.values()) + len(self.starting)
        role = PREFILL if prefill < round(self.prefill_share * (total + 1)) else DECODE
        self.starting.append(role)
        return role

    def started(self, role: str) -> None:
        if role in self.starting:
            self.starting.remove(role)

    def step(self) -> PDMove:
        """Decide; start a switch (a task) when the planner moves a worker."""
        signals = pd_signals(self.name, self.pool, self.state.pd.roles)
        self.last = move = self.planner.decide(signals, self.clock())
        if move.to_role is not None and (self.switching is None or self.switching.done()):
            donor = self.donor(PREFILL if move.to_role == DECODE else DECODE)
            if donor is not None:
                self.switching = asyncio.create_task(self.switch(donor, move.to_role))
        return move

    def donor(self, role: str) -> Endpoint | None:
        """The `role` worker with the least in flight (ties: by URL)."""
        roles = self.state.pd.roles
        found = [e for e in self.pool.endpoints.values()
                 if e.available and (roles.get(e).role == role
                                     or (role == DECODE and roles.get(e).role != PREFILL))]
        return min(found, key=lambda e: (e.inflight, e.url)) if found else None

    async def switch(self, endpoint: Endpoint, role: str) -> None:
        total = len(self.pool.endpoints)
        try:
            await self.state.pd.roles.switch(endpoint, role, self.drain_timeout_s)
        except (SluiceError, OSError) as exc:
            log.warning("pool %s: switching %s to %s failed: %s", self.name, endpoint.url,
                        role, exc)
            return
        prefill = self.state.pd.roles.count(self.pool)[PREFILL]
        self.prefill_share = prefill / max(1, total)  # replacements keep the new ratio
        log.info("pool %s: %s is a %s worker now", self.name, endpoint.url, role)

    def describe(self) -> dict[str, Any]:
        return {"roles": self.state.pd.roles.count(self.pool),
                "prefill_share": self.prefill_share,
                "last": self.last.to_dict() if self.last is not None else None,
                "moves": [m.to_dict() for m in self.planner.moves]}
