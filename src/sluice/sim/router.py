"""The router in virtual time: the production `Pool` (policy, prefix indexes, load
accounting, learned TTFT line), fed the way `sluice router` feeds it.

    arrival      -> RequestMeta (prompt tokens, chained block hashes when the policy
                    uses them) -> pool.decide -> pool.dispatch      (as router/proxy.py)
    first token  -> endpoint.on_first_byte(ticket, learn=True)      (a streamed response)
    last token   -> endpoint.finish(ticket)
    KV events    -> kv_subscriber.apply_event, `kv_event_lag_s` after the engine step
    every `scrape_interval_s` -> endpoint.load = WorkerLoad(running, waiting, kv usage)

What the HTTP path costs is not simulated here; the cluster adds the profile's
`request_overhead_s` around it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.kv_events import BlockRemoved, KVEvent
from sluice.router.config import PoolConfig, WorkerSpec
from sluice.router.endpoints import Ticket
from sluice.router.kv_subscriber import apply_event
from sluice.router.policies import POLICIES, RequestMeta
from sluice.router.pool import Pool
from sluice.router.scrape import WorkerLoad
from sluice.sim.loop import EventLoop

MODEL = "sim"


@dataclass(frozen=True)
class RouterSimConfig:
    policy: str = "cost"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    block_size: int = 16
    scrape_interval_s: float = 0.5  # the router's default
    kv_event_lag_s: float = 0.002  # engine step end -> router index (ZMQ on a LAN)
    prefix_index_blocks: int = 200_000  # the router's default
    predicted_block_ttl_s: float = 10.0  # the router's default
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(f"unknown policy {self.policy!r}; choose from "
                                      f"{sorted(POLICIES)}", param="policy")
        if not 0 < self.scrape_interval_s < math.inf:  # 0: scrapes forever at one instant
            raise InvalidRequestError("scrape_interval_s must be > 0 and finite",
                                      param="scrape_interval_s")
        for name in ("kv_event_lag_s", "predicted_block_ttl_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise InvalidRequestError(f"{name} must be >= 0 and finite", param=name)
        if self.prefix_index_blocks < 1:
            raise InvalidRequestError("prefix_index_blocks must be >= 1",
                                      param="prefix_index_blocks")


class SimRouter:
    """Owns the pool; every call comes from the event loop."""

    def __init__(self, cfg: RouterSimConfig, loop: EventLoop) -> None:
        self.cfg = cfg
        self.loop = loop
        self.pool = Pool(PoolConfig(model=MODEL, policy=cfg.policy, block_size=cfg.block_size,
                                    policy_options=cfg.policy_options),
                         random.Random(cfg.seed), cfg.prefix_index_blocks,
                         cfg.predicted_block_ttl_s, clock=loop.clock)
        self.uses_prefix = self.pool.policy.uses_prefix

    # -- membership (the planner's doing) ----------------------------------------------
    def add_worker(self, url: str) -> None:
        self.pool.add(WorkerSpec(url, kv_events=f"sim://{url[len('http://'):]}"))

    def drain_worker(self, url: str) -> None:
        self.pool.get(url).draining = True

    def remove_worker(self, url: str) -> None:
        self.pool.remove(url)

    # -- a request's life --------------------------------------------------------------
    def route(self, num_prompt_tokens: int, block_hashes: tuple[int, ...],
              session_key: str | None, max_tokens: int) -> Ticket | None:
        """Choose a worker and count the request in flight there; None: no worker."""
        meta = RequestMeta(model=MODEL, num_prompt_tokens=num_prompt_tokens,
                           block_hashes=block_hashes if self.uses_prefix else (),
                           session_key=session_key, max_tokens=max_tokens,
                           block_size=self.cfg.block_size)
        decision = self.pool.decide(meta)
        if decision is None:
            return None
        return self.pool.dispatch(meta, decision)

    @staticmethod
    def first_token(ticket: Ticket) -> None:
        ticket.endpoint.on_first_byte(ticket, learn=True)

    @staticmethod
    def finished(ticket: Ticket) -> None:
        ticket.endpoint.finish(ticket)

    # -- what workers publish ----------------------------------------------------------
    def kv_events(self, url: str, events: list[KVEvent]) -> None:
        """A worker's step published `events`; they reach the index after the lag."""
        self.loop.after(self.cfg.kv_event_lag_s, self._apply, (url, events))

    def _apply(self, item: tuple[str, list[KVEvent]]) -> None:
        """A step's events into the precise index, in order; a run of `BlockRemoved`
        (one per evicted block) as one (the same removals, one index call). Skipped when
        the policy never reads the index (`uses_prefix` false: `Pool` neither matches
        nor predicts there), which changes no decision; the event is still counted."""
        url, events = item
        if not self.uses_prefix or url not in self.pool.endpoints:
            return  # (or the worker left; its entries went with it)
        index = self.pool.precise
        removed: list[int] = []
        medium: str | None = None
        for ev in events:
            if type(ev) is BlockRemoved and (not removed or ev.medium == medium):
                removed += ev.block_hashes
                medium = ev.medium
                continue
            if removed:
                apply_event(index, url, BlockRemoved(removed, medium))
                removed = []
            if type(ev) is BlockRemoved:
                removed += ev.block_hashes
                medium = ev.medium
            else:
                apply_event(index, url, ev)
        if removed:
            apply_event(index, url, BlockRemoved(removed, medium))

    def scrape(self, loads: Iterable[tuple[str, WorkerLoad]]) -> None:
        """Fresh `/metrics` gauges for each worker."""
        endpoints = self.pool.endpoints
        for url, load in loads:
            endpoint = endpoints.get(url)
            if endpoint is not None:
                endpoint.load = load
