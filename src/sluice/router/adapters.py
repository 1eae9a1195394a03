"""LoRA adapters as a fleet-wide resource: who holds which, where to load one, when to drop one.

vLLM's workers load adapters at runtime (`POST /v1/load_lora_adapter`) but do not share
or keep them: "route where it is loaded" makes the hot adapter's worker a hotspot and
evicts in a loop on the others (llm-d-router #709), and a restarted worker forgets what
was loaded over HTTP (vLLM RFC #12174). Here the router owns placement:

    request for adapter A (a model id that is a registered or a discovered adapter)
      cost(w)  = the `cost` policy's seconds for this request on worker w
      holders  = available workers holding A
      share(X) = X's share of recent adapter requests; worth(X) = share(X) / X's replicas
      heat(w)  = the share of adapter requests w's other adapters bring it (each one's
                 share split over its replicas), in steps of 5%: a new copy goes to the
                 coolest worker first, then the cheapest (hot adapters never pile up)
      none     -> load A on the coolest, cheapest worker with a free slot (else evict the
                  copy worth least in the pool, an extra replica first; never one with a
                  request in flight or placed, nor one of an adapter more used than A
                  unless it is in the tail: share < 1/slots of the pool - HEAT_STEP/2),
                  wait, go; no such copy: wait for one to go idle (up to ROOM_WAITS x
                  MIN_IDLE_S), then evict any idle copy as above, else drain the copy
                  worth least (no new requests; unloaded once its requests end) rather
                  than put a worker over its slots
      some     -> replicate when  min cost(non-holder with room) + load_s < min cost(holders)
                  or A is hot: its own requests placed or in flight (2+) and its share
                  of recent requests are both more than the holders' share of the pool
                  (holders / workers), and a non-holder costs less;
                  while A has fewer than `max_adapter_replicas` replicas; the room may be
                  free, or an *extra* replica of another adapter (one with 2+) resident
                  for `min_residency_s` and idle; for a hot A only, also the idle last
                  copy of an adapter at most 1/RARE_FACTOR as used as A's new copy would
                  be (left on too few copies, a hot A keeps its workers over their share
                  of the pool however the rest is placed)
      the request may go to holders only (the proxy excludes the other workers; in a
      pool with a canary, among the workers of the version the request goes to)

    prefix cache: an adapter request's blocks are hashed with the adapter's content hash
    (`cache_salt`, as the worker lists it; the engine keys its KV blocks and events so),
    so no base-model block is a hit for it, nor one of another adapter or older weights

    every sync_interval_s, per worker (`sync`):
      GET /v1/models -> the adapters it holds (entries with a `parent`)
      router-loaded adapters it lacks (it restarted) -> loaded again
      a worker seen for the first time -> pinned adapters, then hot ones under the cap
      an extra replica idle for `idle_unload_s` -> unloaded
      a drained copy whose requests there have ended -> unloaded
      more adapters than slots (a request found no room) -> the idle ones worth least
      unloaded
      a read started before the router's own load or unload there was answered does not
      undo it (else a request meets a 404); a 404 from a holder drops it (routed.py
      places the request again)

Why it does not thrash: a replica is added only when the queue it saves is longer than
a load, up to a cap; a replica is evicted only after its residency and only while idle;
the last copy of an adapter is evicted only for a request that finds no holder at all,
or for a hot adapter's copy when it is rarely used; the copy evicted is the one worth
least (plain LRU evicts a busy adapter's only copy that happened to be idle a moment);
a request does not evict a copy more used than its own adapter while it may still wait
for another (unless that adapter is in the tail: the tail's adapters, each well under one
slot's worth of requests, share the slots the hot ones leave); no worker is pushed over
its slots (its engine would read weights on every other request, and while its adapters
stay busy none is ever idle to trim).
`load_s` starts at the configured prior and learns the measured load durations.

State is touched only on the event loop; a load in progress is one shared future per
(worker, adapter), so concurrent requests wait for it instead of loading twice.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
from prometheus_client import CollectorRegistry, Counter

from sluice.protocol.errors import InvalidRequestError, NotFoundError
from sluice.router.config import AdapterPlacement, AdapterSpec
from sluice.router.policies import RequestMeta
from sluice.router.policies.cost import costs
from sluice.router.pool import Pool
from sluice.router.proxy import Relay

log = logging.getLogger(__name__)

MIN_IDLE_S = 0.05  # none in flight and none routed this long: an adapter may be evicted
# (a request routed meanwhile that finds it gone gets one more placement: routed.py)
LOAD_EWMA = 0.2  # weight of each measured load duration in `load_s`
DEMAND_EWMA = 0.1  # weight of each sync interval's request count in an adapter's demand
DEFAULT_CAPACITY = 8  # adapters per worker when neither the config nor the worker says
WAIT = "wait"  # a decided "load" that only waits for another request's load
HOT_MIN_INFLIGHT = 2  # an adapter with fewer in flight is never "hot" (`_hot`)
HEAT_STEP = 0.05  # request shares closer than this are equally hot (`_heat`)
ROOM_WAITS = 10  # MIN_IDLE_S waits for an idle copy before a load goes over a worker's slots
RARE_FACTOR = 2  # a hot adapter's new copy may take the last copy of one this many times
# less used than the copy would be (`_displace`)
_MAX_LORA = re.compile(r'max_lora="(\d+)"')


@dataclass
class Holding:
    """One adapter on one worker, as the router knows it."""

    loaded_at: float
    by_router: bool  # the router loaded it (and so restores it after a restart)
    last_used: float = 0.0  # a request was sent to it, or ended there
    decided: float = 0.0  # a request for it was routed (to this or another holder)


@dataclass
class AdapterCounts:
    """Loads and unloads the router made, by reason (tests and the benchmark read them)."""

    loads: dict[str, int] = field(default_factory=dict)
    unloads: dict[str, int] = field(default_factory=dict)
    loads_by_adapter: dict[str, int] = field(default_factory=dict)

    def total_loads(self) -> int:
        return sum(self.loads.values())


class Adapters:
    """Placement of the registered adapters over the pools' workers."""

    def __init__(self, specs: Iterable[AdapterSpec], placement: AdapterPlacement,
                 client: httpx.AsyncClient, pools: Callable[[], list[Pool]],
                 registry: CollectorRegistry, clock: Callable[[], float] = time.monotonic,
                 read_timeout_s: float = 2.0) -> None:
        """`read_timeout_s`: a worker's /v1/models and /metrics in a sync round (a hung
        worker's would hold the round, and a router starting beside it)."""
        self.specs: dict[str, AdapterSpec] = {s.name: s for s in specs}
        self.placement = placement
        self.client = client
        self.read_timeout = httpx.Timeout(read_timeout_s)
        self.pools = pools
        self.clock = clock
        self.load_s = placement.load_s
        self.held: dict[str, dict[str, Holding]] = {}  # worker url -> adapter -> holding
        self.assigned: dict[str, set[str]] = {}  # worker url -> adapters the router loaded
        self.capacity: dict[str, int] = {}  # worker url -> its max_lora, as scraped
        self.loading: dict[tuple[str, str], asyncio.Future[bool]] = {}
        self.inflight: dict[tuple[str, str], int] = {}  # (worker, adapter) -> requests
        self.placing: dict[str, int] = {}  # adapter -> requests placed, not yet sent
        self.draining: set[tuple[str, str]] = set()  # (worker, adapter): no new requests,
        # unloaded once its requests there end (`_drain`)
        # (worker, adapter) -> when the router's last load or unload there was answered
        # (inf while an unload is on its way): a read started before knows less (`sync`)
        self.changed: dict[tuple[str, str], float] = {}
        self.demand: dict[str, float] = {}  # adapter -> requests per sync interval (EWMA)
        self.recent: dict[str, int] = {}  # adapter -> requests since the last sync
        self.content: dict[str, str] = {}  # adapter -> content hash, as a worker lists it
        self.listed: dict[str, tuple[str, str | None]] = {}  # adapter -> (parent, root),
        # as a worker lists it
        self.counts = AdapterCounts()
        self._loads = Counter("sluice_router_adapter_loads", "adapter loads the router made",
                              ["adapter", "reason"], registry=registry)
        self._unloads = Counter("sluice_router_adapter_unloads",
                                "adapter unloads the router made", ["adapter", "reason"],
                                registry=registry)

    # --- registry -----------------------------------------------------------------------

    def register(self, spec: AdapterSpec) -> None:
        """Add or replace an adapter the router may load (its path, its base model)."""
        self.specs[spec.name] = spec

    async def unregister(self, name: str) -> None:
        """Forget `name` and unload it wherever the router loaded it."""
        if self.specs.pop(name, None) is None:
            raise NotFoundError(f"no adapter {name!r} is registered", param="name",
                                code="adapter_not_found")
        for url, names in self.assigned.items():
            if name in names:
                await self._unload(url, name, "unregister")

    def is_adapter(self, model: str) -> bool:
        return model in self.specs or any(model in h for h in self.held.values())

    def base_of(self, model: str) -> str | None:
        """A registered adapter's base model (None: unknown adapter or no base named)."""
        spec = self.specs.get(model)
        return spec.base if spec is not None else None

    def cache_salt(self, model: str) -> bytes:
        """What the engine mixes into `model`'s KV block hashes (`hash_block`'s `extra`):
        b"" for a base model; for an adapter, its content hash as a worker lists it (the
        engine's `cache_salt`, so the router's hashes equal those of the KV events), else
        one derived from its name (only the router's own dispatch records match it; never
        a base model's block, never another adapter's)."""
        if not self.is_adapter(model):
            return b""
        content = self.content.get(model)
        if content:
            try:
                return bytes.fromhex(content)
            except ValueError:
                pass
        return b"lora-name:" + model.encode()

    def lineage(self, model: str) -> tuple[str | None, str | None] | None:
        """An adapter's (parent, root) for /v1/models, vLLM's shape: a registered one's
        base and path, else what a worker listing it says; None for a base model."""
        spec = self.specs.get(model)
        if spec is not None:
            return spec.base, spec.path
        return self.listed.get(model) if self.is_adapter(model) else None

    def holders(self, model: str) -> list[str]:
        return sorted(url for url, held in self.held.items() if model in held)

    def describe(self) -> list[dict[str, object]]:
        return [{"name": s.name, "path": s.path, "base": s.base, "pinned": s.pinned,
                 "workers": self.holders(s.name), "demand": round(self.demand.get(s.name, 0), 3)}
                for s in self.specs.values()]

    # --- per request --------------------------------------------------------------------

    async def prepare(self, pool: Pool, model: str, meta: RequestMeta,
                      unplaceable: Iterable[str] = ()) -> tuple[str, ...]:
        """Make sure a worker that is worth it holds `model` (loading it if needed; never
        one of `unplaceable`: a disaggregated pool's prefill workers, which cannot serve
        a request whole) and return the workers the request must not go to (those without
        it). Nothing for a model that is not an adapter."""
        if not self.is_adapter(model):
            return ()
        self.placing[model] = self.placing.get(model, 0) + 1
        try:
            return await self._prepare(pool, model, meta, unplaceable)
        except BaseException:
            self.unplace(model)
            raise

    def unplace(self, model: str) -> None:
        """A request `prepare` placed will not be sent as placed (an error, or a 404 that
        places it again): its adapter is no longer kept for it."""
        left = self.placing.get(model, 0) - 1
        if left > 0:
            self.placing[model] = left
        else:
            self.placing.pop(model, None)

    async def _prepare(self, pool: Pool, model: str, meta: RequestMeta,
                       unplaceable: Iterable[str]) -> tuple[str, ...]:
        self.recent[model] = self.recent.get(model, 0) + 1
        holders: list[str] = []
        for held in self.held.values():  # one may be chosen now: not evicted before it is sent
            if model in held:
                held[model].decided = self.clock()
        waited, full_waits = False, 0
        while True:  # once more after waiting for another request's load, or for room
            endpoints = pool.candidates(meta.num_prompt_tokens, unplaceable, meta.version)
            if not endpoints:
                return ()
            urls = [e.url for e in endpoints]
            seconds = dict(zip(urls, costs(meta, pool._stats(meta, endpoints)), strict=True))
            holders = [u for u in urls if model in self.held.get(u, {})]
            pool_inflight = sum(e.inflight for e in endpoints)
            patient = full_waits < ROOM_WAITS  # every copy worth keeping is busy: one
            target = self._target(model, urls, holders, seconds, pool_inflight, patient)
            if target is None:
                break
            if target.over and patient:  # will be idle soon, and a worker over its slots
                full_waits += 1  # swaps weights on every other request
                await asyncio.sleep(MIN_IDLE_S)
                continue
            loaded = await target
            if target.reason == WAIT and not waited:
                waited = True
                continue
            if loaded and target.url not in holders:
                holders.append(target.url)
            break
        if not holders:
            return ()  # could not load it anywhere: let the workers answer (404)
        return tuple(u for u in pool.endpoints  # a prefill worker holding it may prefill
                     if u not in holders and model not in self.held.get(u, {}))

    def served(self, relay: Relay, model: str) -> None:
        """A request for `model` is on `relay`'s worker until the relay closes: counted in
        flight there (never evicted meanwhile), and its last use is stamped."""
        if model in self.placing:
            self.unplace(model)
        if not self.is_adapter(model):
            return
        url = relay.ticket.endpoint.url
        key = (url, model)
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self._stamp(url, model)
        previous = relay.on_close

        def done(ended: Relay) -> None:
            try:
                if previous is not None:
                    previous(ended)
            finally:
                self.inflight[key] -= 1
                self._stamp(url, model)

        relay.on_close = done

    def lost(self, url: str, model: str) -> None:
        """`url` answered 404 for `model`, which the router thought it held (a restart, an
        unload the router did not make): not a holder until a sync reads it back (one the
        router loaded is loaded again there by that sync)."""
        if self.held.get(url, {}).pop(model, None) is not None:
            self.changed[(url, model)] = self.clock()
            self._set_listed(url, model, False)

    def _stamp(self, url: str, model: str) -> None:
        holding = self.held.get(url, {}).get(model)
        if holding is not None:
            holding.last_used = self.clock()

    def busy(self, url: str, model: str) -> bool:
        """In flight there, or used in the last MIN_IDLE_S (a request decided but not yet
        sent)."""
        holding = self.held.get(url, {}).get(model)
        return self.inflight.get((url, model), 0) > 0 or model in self.placing or (
            holding is not None
            and self.clock() - max(holding.last_used, holding.decided) < MIN_IDLE_S)

    def _target(self, model: str, urls: list[str], holders: list[str],
                seconds: dict[str, float], pool_inflight: int = 0,
                patient: bool = False) -> _Load | None:
        spec = self.specs.get(model)
        if spec is None:
            return None  # discovered, not registered: its path is unknown
        pending = [u for (u, m) in self.loading if m == model and u in seconds]
        if not holders:
            if pending:  # another request is loading it: wait for that load
                return _Load(self, pending[0], model, None, WAIT)
            return self._place(model, urls, seconds, patient)
        if len(holders) + len(pending) >= self._cap(model, len(urls)):
            return None
        best_holder = min(seconds[u] for u in holders)
        hot = self._hot(model, holders, len(urls), pool_inflight)
        options = [u for u in urls if u not in holders and u not in pending
                   and (seconds[u] + self.load_s < best_holder
                        or (hot and seconds[u] < best_holder))]
        if not options:
            return None
        heat = self._heat(model)
        ordered = sorted(options, key=lambda u: (heat(u), seconds[u]))
        for url in ordered:
            victim = self._room(url, extra_only=True)
            if victim is not False:
                return _Load(self, url, model, _name(victim), "replicate")
        return self._displace(model, ordered, len(holders)) if hot else None

    def _displace(self, model: str, urls: list[str], replicas: int) -> _Load | None:
        """A hot adapter's new copy when every slot of `urls` holds some adapter's last
        copy: it takes the idle last copy of an adapter at most 1/RARE_FACTOR as used as
        the new copy would be, on the worker coolest once it is gone (`_heat`), the one
        worth least among equals (a hot adapter is one whose copies alone bring their
        workers more than a worker's share of the pool, `_hot`: left on one copy it keeps
        that worker over its share however the rest is placed)."""
        shares, worth, heat = self.shares(), self._worth(), self._heat(model)
        rare = shares.get(model, 0.0) / (replicas + 1) / RARE_FACTOR
        victims = [(heat(url, name), worth(name), i, url, name) for i, url in enumerate(urls)
                   for name in self.held.get(url, {})
                   if shares.get(name, 0.0) <= rare and self._evictable(url, name)
                   and len(self.holders(name)) == 1]
        if not victims:
            return None
        *_, url, victim = min(victims)
        return _Load(self, url, model, victim, "replicate")

    def _hot(self, model: str, holders: list[str], workers: int, pool_inflight: int) -> bool:
        """The adapter's own requests, placed and not yet answered (this one included)
        or in flight on its holders, are more than its holders' share of the pool's in
        flight, and so is its share of recent requests: its holders are busy because of
        it, whatever their queue looks like to the cost model (which prices the time
        after a first token as cheap decode, and sees a scrape late). The in-flight count is exact and immediate but noisy; the
        share keeps a moderately hot adapter from replicating on a chance burst."""
        own = self.placing.get(model, 0) + sum(self.inflight.get((u, model), 0) for u in holders)
        return (own >= HOT_MIN_INFLIGHT and own * workers > len(holders) * (pool_inflight + 1)
                and self.shares().get(model, 0.0) * workers > len(holders))

    def shares(self) -> dict[str, float]:
        """Each adapter's share of recent adapter requests: the demand EWMA as if this
        interval ended now (its partial count weighs as one interval, not as the whole
        history: else a few requests since the last sync swing every share)."""
        recent = {n: (1 - DEMAND_EWMA) * self.demand.get(n, 0.0)
                  + DEMAND_EWMA * self.recent.get(n, 0)
                  for n in self.demand.keys() | self.recent.keys()}
        total = sum(recent.values())
        return {n: r / total for n, r in recent.items()} if total else {}

    def _heat(self, model: str) -> Callable[..., int]:
        """Worker url (and an adapter `gone` from it) -> the share of adapter requests
        its other adapters bring it (each adapter's share split over its replicas, loads
        in progress counted), in steps of HEAT_STEP: where a new copy of `model` goes
        first, so that hot adapters do not end on one worker."""
        on: dict[str, set[str]] = {u: set(held) for u, held in self.held.items()}
        for u, name in self.loading:
            on.setdefault(u, set()).add(name)
        replicas: dict[str, int] = {}
        for names in on.values():
            for name in names:
                replicas[name] = replicas.get(name, 0) + 1
        shares = self.shares()
        split = {name: shares.get(name, 0.0) / n for name, n in replicas.items()
                 if name != model}

        def heat(url: str, gone: str | None = None) -> int:
            return round(sum(split.get(name, 0.0) for name in on.get(url, ()) if name != gone)
                         / HEAT_STEP)

        return heat

    def _cap(self, model: str, workers: int) -> int:
        spec = self.specs.get(model)
        return workers if spec is not None and spec.pinned else self.placement.max_adapter_replicas

    def _place(self, model: str, urls: list[str], seconds: dict[str, float],
               patient: bool = False) -> _Load:
        """Where a request with no holder loads its adapter: the coolest (`_heat`), then
        cheapest worker with a free slot, else where the pool's evictable copy worth
        least is (`_worth`; an extra replica past its residency first), else the coolest
        (over capacity). `patient`: no copy of an adapter more used than `model` (in
        HEAT_STEP steps) is evicted unless that adapter is in the tail (`_tail`: an idle
        tail copy is taken, however its share compares with `model`'s), and no worker
        goes over its slots: the load is `over` instead (the request waits for such a
        copy to go idle: a hot adapter's extra replica idle a moment is not given to the
        tail, to be taken back a moment later).
        Not `patient` (waited long enough): the copy worth least, busy or not, of an
        adapter no more used than `model` first, is drained (`_drain`) for it."""
        heat, worth, steps = self._heat(model), self._worth(), self._steps()
        ordered = sorted(urls, key=lambda u: (heat(u), seconds[u]))
        most = steps(model) if patient else math.inf
        tail = self._tail(urls)
        for extra_only in (True, False):
            rooms = [(url, self._room(url, extra_only=extra_only, residency=extra_only))
                     for url in ordered]
            free = [url for url, victim in rooms if victim is True]
            if free:
                return _Load(self, free[0], model, None, "demand")
            # the copy that serves least in the pool goes, wherever it is (a worker's own
            # least-worth copy may be a busy adapter's only one)
            victims = [(worth(v), i, url, v) for i, (url, v) in enumerate(rooms)
                       if isinstance(v, str) and (steps(v) <= most or tail(v))]
            if victims:
                _, _, url, victim = min(victims)
                return _Load(self, url, model, victim, "demand")
        if not patient:
            drains = [(steps(v) > steps(model), worth(v), i, url, v)
                      for i, url in enumerate(ordered) for v in self.held.get(url, {})
                      if v in self.specs and not self.specs[v].pinned]
            if drains:
                *_, url, victim = min(drains)
                return _Load(self, url, model, victim, "demand", drain=True)
        return _Load(self, ordered[0], model, None, "demand", over=True)

    def _room(self, url: str, *, extra_only: bool, residency: bool = True) -> str | bool:
        """True: `url` has a free slot; an adapter's name: room once it is evicted (the
        one worth least, `_worth`); False: no room. `extra_only`: evict only an adapter
        with another replica."""
        held = self.held.get(url, {})
        busy = sum(1 for (u, _) in self.loading if u == url)
        if len(held) + busy < self._capacity(url):
            return True
        now = self.clock()
        worth = self._worth()
        victims = [(worth(name), h.last_used, name) for name, h in held.items()
                   if self._evictable(url, name)
                   and (not residency or now - h.loaded_at >= self.placement.min_residency_s)
                   and (not extra_only or len(self.holders(name)) > 1)]
        return min(victims)[2] if victims else False

    def _evictable(self, url: str, name: str) -> bool:
        """Registered, not pinned and idle (`busy`)."""
        return name in self.specs and not self.specs[name].pinned and not self.busy(url, name)

    def _worth(self) -> Callable[[str], float]:
        """Adapter -> its share of recent requests per replica, in steps of HEAT_STEP: the
        copy that serves least goes first (least recently used among equals), so a busy
        adapter's only copy never makes room for a rarely used one because it happened
        to be idle a moment (plain LRU evicts by that moment)."""
        shares = self.shares()

        def worth(name: str) -> float:
            return round(shares.get(name, 0.0) / max(1, len(self.holders(name))) / HEAT_STEP)

        return worth

    def _steps(self) -> Callable[[str], int]:
        """Adapter -> its share of recent requests, in steps of HEAT_STEP."""
        shares = self.shares()
        return lambda name: round(shares.get(name, 0.0) / HEAT_STEP)

    def _tail(self, urls: list[str]) -> Callable[[str], bool]:
        """Adapter -> whether it is in the tail: its share of recent requests is under one
        slot's worth of `urls` (1 / their slots) by more than half a HEAT_STEP. The tail's
        adapters share the slots the hot ones leave: a tail request that waited for an
        idle copy of one only a step more used than its own waited for a slot that serves
        no more than it would (`_place`)."""
        shares = self.shares()
        below = 1 / max(1, sum(self._capacity(u) for u in urls)) - HEAT_STEP / 2
        return lambda name: shares.get(name, 0.0) < below

    def _capacity(self, url: str) -> int:
        if self.placement.adapters_per_worker is not None:
            return self.placement.adapters_per_worker
        return self.capacity.get(url, DEFAULT_CAPACITY)

    # --- loading and unloading ------------------------------------------------------------

    async def load(self, url: str, model: str, reason: str, victim: str | None = None,
                   drain: bool = False) -> bool:
        """Load `model` on `url` (after unloading `victim` there, or draining it: `drain`);
        True once it holds it. One load per (worker, adapter) at a time: a second caller
        waits for the first."""
        key = (url, model)
        if key in self.loading:
            return await self.loading[key]
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.loading[key] = future
        try:
            if drain and victim is not None:
                self._drain(url, victim)
            elif victim is not None:
                await self._unload(url, victim, "evict")
            ok = await self._post_load(url, self.specs[model])
            if ok:
                now = self.clock()
                self.changed[key] = now
                self._set_listed(url, model, True)
                self.held.setdefault(url, {})[model] = Holding(now, True, now)
                self.assigned.setdefault(url, set()).add(model)
                self.counts.loads[reason] = self.counts.loads.get(reason, 0) + 1
                by = self.counts.loads_by_adapter
                by[model] = by.get(model, 0) + 1
                self._loads.labels(model, reason).inc()
            future.set_result(ok)
            return ok
        finally:
            del self.loading[key]
            if not future.done():  # cancelled: the waiters learn it did not load
                future.set_result(False)

    async def _post_load(self, url: str, spec: AdapterSpec) -> bool:
        start = self.clock()
        try:
            resp = await self.client.post(url + "/v1/load_lora_adapter",
                                          json={"lora_name": spec.name, "lora_path": spec.path})
        except httpx.HTTPError as exc:
            log.warning("loading adapter %s on %s failed: %s", spec.name, url, exc)
            return False
        if resp.status_code == 200 or "already been loaded" in resp.text:
            self.load_s += LOAD_EWMA * (self.clock() - start - self.load_s)
            return True
        log.warning("loading adapter %s on %s: %d %s", spec.name, url, resp.status_code,
                    resp.text[:200])
        return False

    def _drain(self, url: str, model: str) -> None:
        """Stop routing `model` to `url` at once (its slot is another's now) and unload it
        there once its requests there have ended (`_drop_idle`): a busy copy is never
        unloaded under its requests, and a worker kept over its slots by busy adapters
        would swap weights on every other request."""
        self._stop_routing(url, model)
        self.draining.add((url, model))

    async def _unload(self, url: str, model: str, reason: str) -> None:
        """Stop routing `model` to `url` at once, then unload it there."""
        self._stop_routing(url, model)
        try:
            await self.client.post(url + "/v1/unload_lora_adapter", json={"lora_name": model})
        except httpx.HTTPError as exc:
            log.warning("unloading adapter %s on %s failed: %s", model, url, exc)
            return
        finally:
            self.changed[(url, model)] = self.clock()
        self.counts.unloads[reason] = self.counts.unloads.get(reason, 0) + 1
        self._unloads.labels(model, reason).inc()

    def _stop_routing(self, url: str, model: str) -> None:
        """`url` no longer holds `model` for routing; until its unload there is answered,
        a read of the worker's adapters may still list it (`sync`)."""
        self.held.get(url, {}).pop(model, None)
        self.assigned.get(url, set()).discard(model)
        self._set_listed(url, model, False)
        self.changed[(url, model)] = math.inf

    def _set_listed(self, url: str, model: str, listed: bool) -> None:
        """Keep the worker's model ids (what the proxy may send it unchanged) in step."""
        for pool in self.pools():
            endpoint = pool.endpoints.get(url)
            if endpoint is not None:
                others = tuple(m for m in endpoint.models if m != model)
                endpoint.models = (*others, model) if listed else others

    # --- background: read back, restore, warm, drop ----------------------------------------

    async def sync_all(self) -> None:
        """One round over every worker (the app runs it every `sync_interval_s`)."""
        for name, count in list(self.recent.items()) + [(n, 0) for n in self.demand
                                                          if n not in self.recent]:
            old = self.demand.get(name, 0.0)
            self.demand[name] = old + DEMAND_EWMA * (count - old)
        self.recent.clear()
        if not self.specs and not any(self.held.values()) \
                and not any(len(e.models) > 1 for p in self.pools() for e in p.endpoints.values()):
            return  # no adapters anywhere: nothing to read back
        await asyncio.gather(*(self.sync(pool, url) for pool in self.pools()
                               for url, e in list(pool.endpoints.items()) if e.available))
        self._forget_removed()

    async def sync(self, pool: Pool, url: str) -> None:
        started = self.clock()
        read = await self._read_adapters(url)
        if read is None:
            return
        ids, found = read
        if url in pool.endpoints:
            pool.endpoints[url].models = ids
        first = url not in self.held
        old = self.held.get(url, {})
        held: dict[str, Holding] = {}
        for name in found | set(old):
            if self.changed.get((url, name), -1.0) >= started or (url, name) in self.loading:
                if name in old:  # the router loaded or unloaded it while the read was on
                    held[name] = old[name]  # its way: what the router knows is newer
            elif name in found:
                held[name] = old.get(name) or Holding(started, False)
        self.held[url] = held
        for name in sorted(self.assigned.get(url, set()) - set(self.held[url])):
            if name in self.specs:  # the worker restarted without it
                await self.load(url, name, "restore")
        await self._fill(pool, url, first)
        await self._drop_idle(url)

    async def _read_adapters(self, url: str) -> tuple[tuple[str, ...], set[str]] | None:
        """The worker's model ids, and which of them are adapters (have a `parent`)."""
        try:
            resp = await self.client.get(url + "/v1/models", timeout=self.read_timeout)
            data = resp.json().get("data", []) if resp.status_code == 200 else None
            if self.placement.adapters_per_worker is None and url not in self.capacity:
                metrics = await self.client.get(url + "/metrics", timeout=self.read_timeout)
                match = _MAX_LORA.search(metrics.text)
                if match:
                    self.capacity[url] = int(match.group(1))
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        entries = [m for m in data if isinstance(m, dict) and "id" in m]
        for m in entries:
            if m.get("parent") and isinstance(m.get("content_hash"), str):
                self.content[str(m["id"])] = m["content_hash"]
            if m.get("parent"):
                root = m.get("root")
                self.listed[str(m["id"])] = (str(m["parent"]),
                                             root if isinstance(root, str) else None)
        return (tuple(str(m["id"]) for m in entries),
                {str(m["id"]) for m in entries if m.get("parent")})

    async def _fill(self, pool: Pool, url: str, first: bool) -> None:
        """Pinned adapters everywhere; on a new worker also the hottest adapters that are
        below their replica cap, while it has free slots."""
        mine = [s for s in self.specs.values() if s.base is None or pool.serves(s.base)]
        wanted = [s.name for s in mine if s.pinned]
        if first:
            hot = sorted((s for s in mine if not s.pinned and self.demand.get(s.name, 0) > 0),
                         key=lambda s: -self.demand.get(s.name, 0.0))
            wanted += [s.name for s in hot
                       if len(self.holders(s.name)) < self.placement.max_adapter_replicas]
        for name in wanted:
            if name in self.held[url]:
                continue
            if self._room(url, extra_only=True) is not True:
                break
            await self.load(url, name, "pinned" if self.specs[name].pinned else "warm")

    async def _drop_idle(self, url: str) -> None:
        """Unload extra replicas idle for `idle_unload_s`; and while the worker holds more
        than its slots (a request found no room anywhere), its least recently used
        router-loaded adapters idle for MIN_IDLE_S."""
        for u, name in sorted(self.draining):
            if u == url and not self.inflight.get((u, name), 0):
                self.draining.discard((u, name))
                await self._unload(u, name, "evict")
        now, idle = self.clock(), self.placement.idle_unload_s
        held = self.held.get(url, {})
        for name, h in list(held.items()):
            spec = self.specs.get(name)
            if (h.by_router and spec is not None and not spec.pinned
                    and now - max(h.last_used, h.loaded_at) >= idle
                    and len(self.holders(name)) > 1 and not self.busy(url, name)):
                await self._unload(url, name, "idle")
        over = len(held) - self._capacity(url)
        worth = self._worth()
        trimmable = sorted((worth(name), h.last_used, name) for name, h in held.items()
                           if h.by_router and name in self.specs and not self.specs[name].pinned
                           and not self.busy(url, name))
        for _, _, name in trimmable[:max(0, over)]:
            await self._unload(url, name, "trim")

    def _forget_removed(self) -> None:
        known = {url for pool in self.pools() for url in pool.endpoints}
        for url in [u for u in self.held if u not in known]:
            self.held.pop(url, None)
            self.capacity.pop(url, None)
            # `assigned` is kept: a worker that comes back under the same URL is restored


def _name(victim: str | bool) -> str | None:
    return victim if isinstance(victim, str) else None


@dataclass
class _Load:
    """A decided load, awaited by the request that needs it (`await target`)."""

    adapters: Adapters
    url: str
    model: str
    victim: str | None
    reason: str
    over: bool = False  # no free slot nor idle copy anywhere: the worker goes over its slots
    drain: bool = False  # the victim is busy: drained (`Adapters._drain`), not unloaded now

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.adapters.load(self.url, self.model, self.reason, self.victim,
                                  self.drain).__await__()


def check_adapter_body(body: object) -> AdapterSpec:
    """`POST /admin/adapters` body -> AdapterSpec (400 naming the field otherwise)."""
    if not isinstance(body, dict):
        raise InvalidRequestError("expected a JSON object {name, path, base?, pinned?}",
                                  param="body")
    unknown = sorted(set(body) - {"name", "path", "base", "pinned"})
    if unknown:
        raise InvalidRequestError(f"unknown adapter field(s): {', '.join(unknown)}",
                                  param=unknown[0])
    for key in ("name", "path"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise InvalidRequestError(f"'{key}' must be a non-empty string", param=key)
    return AdapterSpec(body["name"], body["path"], body.get("base"), bool(body.get("pinned")))
