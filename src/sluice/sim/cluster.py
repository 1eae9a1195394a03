"""One simulated cluster run: clients, the router, N workers, the planner, in virtual time.

    session start ──(overhead/2)──► route (real Pool + policy) ──► SimWorker.add
    worker steps (real Scheduler + BlockManager; step time from the profile)
    first token ──► router learns TTFT ──(overhead/2)──► client's TTFT
    last token  ──► router.finish ──(overhead/2)──► client's E2E; next turn (multi-turn)
    every scrape_interval_s: workers' gauges -> router      KV events -> router index
    every planner_interval_s: workers' latency histograms -> window (as the controller
                              scrapes /metrics); pool_signals(real Pool) ->
                              planner.desired_replicas -> start (cold start) / cancel / drain

The run returns the bench's `RequestRecord`s (so `sluice.bench.metrics.summarize` and
`report.table` give the same numbers as `sluice bench serve`) plus what only a
simulator knows: the oracle hit rate (one infinite prefix cache holding every earlier
request's prompt and answer, in arrival order), replica count over time, worker-hours,
scale events, goodput per worker-second, per-worker load, events/s.
"""

from __future__ import annotations

import gc
import math
import operator
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from sluice.bench.client import RequestRecord
from sluice.bench.metrics import summarize
from sluice.bench.workloads import Session
from sluice.control.planner import PoolSignals
from sluice.control.signals import LatencyWindow, pool_signals
from sluice.protocol.block_hash import hash_block, hash_blocks
from sluice.protocol.errors import InvalidRequestError
from sluice.router.buffer import RequestBuffer
from sluice.router.endpoints import Ticket
from sluice.router.scrape import WorkerLoad
from sluice.sim.loop import EventLoop
from sluice.sim.planner import FixedPlanner, PoolObservation, ReplicaPlanner, WorkerLatency
from sluice.sim.profile import StepProfile
from sluice.sim.router import MODEL, RouterSimConfig, SimRouter
from sluice.sim.worker import SimRequest, SimWorker
from sluice.sim.workload import KeyedSegment, turn_prompt


@dataclass(frozen=True)
class SimConfig:
    workers: int = 16
    profile: StepProfile = field(default_factory=StepProfile)
    router: RouterSimConfig = field(default_factory=RouterSimConfig)
    scheduling_policy: str = "priority"
    max_concurrency: int | None = None
    planner_interval_s: float = 1.0  # the production controller's interval
    cold_start_s: float = 11.0  # docs/control.md: a CPU worker's start to first token
    latency_window_s: float = 30.0  # the controller's TTFT / ITL window
    slos: dict[str, float] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidRequestError("workers must be >= 1", param="workers")
        if self.router.block_size != self.profile.block_size:
            raise InvalidRequestError("the router's block_size must be the engine's",
                                      param="block_size")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequestError("max_concurrency must be >= 1", param="max_concurrency")
        if not (0 < self.planner_interval_s < math.inf and 0 < self.latency_window_s < math.inf
                and 0 <= self.cold_start_s < math.inf):
            raise InvalidRequestError("planner_interval_s and latency_window_s must be > 0, "
                                      "cold_start_s >= 0, all finite", param="planner_interval_s")


def _enable_gc_as_old() -> None:
    """`gc.enable()`, with what was allocated while it was off counted as old: the run's
    survivors (its records, the workers' and the router's state; millions of tracked
    objects) go to the oldest generation instead of the youngest, whose first pass after
    a run walked all of them (0.19 s of a 4 s run at 16 workers) only to promote them. A
    full collection still walks them and finds any cycle. (`freeze` and `unfreeze` move
    the generations' lists whole; skipped where the process keeps frozen objects of its
    own, as `sluice router` does, which `unfreeze` would release.)"""
    if gc.get_freeze_count() == 0:
        gc.freeze()  # every tracked object, the young ones included, to the permanent set
        gc.unfreeze()  # ... and back, into the oldest generation
    gc.enable()


@dataclass
class _Flight:
    """A request in the air: its session, turn, router ticket and the client's record."""

    session: Session
    turn: int
    answers: list[list[int]]
    record: RequestRecord
    ticket: Ticket | None = None
    hashes: tuple[int, ...] = ()  # the prompt's full blocks
    keyed: KeyedSegment | None = None  # the prompt, when it is a trace row's keyed blocks


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration: float
    summary: dict[str, Any]


class Simulation:
    """Owns the loop, the router, the workers and the planner of one run."""

    def __init__(self, cfg: SimConfig, planner: ReplicaPlanner | None = None) -> None:
        self.cfg = cfg
        self.loop = EventLoop()
        self.router = SimRouter(cfg.router, self.loop)
        self.planner = planner if planner is not None else FixedPlanner(cfg.workers)
        self.workers: dict[str, SimWorker] = {}  # every worker ever started, by url
        self.serving: list[str] = []
        self.draining: set[str] = set()
        self.cold: list[str] = []  # started, in their cold start (oldest first)
        self.desired = cfg.workers
        self.scale_events = 0
        self.latency: dict[str, WorkerLatency] = {}  # url -> what its /metrics would show
        self.window = LatencyWindow(cfg.latency_window_s)
        self.no_buffer = RequestBuffer(max_requests=0, timeout_s=0.0)  # the sim holds none
        self.lifetimes: dict[str, list[float]] = {}  # url -> [started, stopped or inf]
        self.replicas: list[tuple[float, int, int, int]] = []  # t, serving, cold, draining
        self.records: list[RequestRecord] = []
        self._pending: deque[Session] = deque()
        self._active = 0
        self._outstanding = 0
        self._arrivals = 0
        self._ttfts: list[float] = []
        self._next_worker = 0
        self._oracle_seen: set[int] = set()
        self._touched: set[str] = set()  # workers changed since the last scrape
        self._host = [0]  # busy workers (one host: profile.host_contention)
        self.oracle_queries = 0
        self.oracle_hits = 0
        for _ in range(cfg.workers):
            self._start_worker(cold=False)

    # -- the run -----------------------------------------------------------------------
    def run(self, timed: Iterable[tuple[Session, float]]) -> SimResult:
        wall = time.perf_counter()
        arrivals = [(at, session) for session, at in timed]
        self._outstanding += len(arrivals)
        self.loop.at_each(self._arrive, arrivals)
        self.loop.at(0.0, self._scrape)
        self.loop.at(0.0, self._plan)
        # No cyclic GC while the loop runs: a run allocates millions of short-lived
        # tracked objects (chunks, tickets, events) over a heap of long-lived ones (1,000
        # workers' block tables, every prompt), and the collector's passes over them were
        # 15-20% of a run. A run makes little cyclic garbage; it is collected after.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self.loop.run()
        finally:
            if collecting:
                _enable_gc_as_old()
        end = max((r.start + r.e2e for r in self.records if r.e2e is not None), default=0.0)
        for span in self.lifetimes.values():
            span[1] = min(span[1], end)
        summary = self._summary(end, time.perf_counter() - wall)
        return SimResult(self.records, end, summary)

    def _busy(self) -> bool:
        return self._outstanding > 0

    # -- clients -----------------------------------------------------------------------
    def _arrive(self, session: Session) -> None:
        if self.cfg.max_concurrency and self._active >= self.cfg.max_concurrency:
            self._pending.append(session)
            return
        self._active += 1
        self._send(session, 0, [])

    def _send(self, session: Session, k: int, answers: list[list[int]]) -> None:
        prompt = turn_prompt(session, k, answers)
        record = RequestRecord(session.index, k, self.loop.now, len(prompt),
                               session.turns[k].output_len,
                               request_id=f"sim-{session.index}-{k}")
        flight = _Flight(session, k, answers, record)
        user = session.turns[k].user
        if k == 0 and session.system is None and isinstance(user, KeyedSegment):
            flight.keyed = user  # the prompt is exactly its ids
        req = SimRequest(record.request_id, prompt, session.turns[k].output_len,
                         self.loop.now, token_seed=session.index * 1009 + k,
                         session_key=session.session_id, on_first_token=self._on_first_token,
                         on_finish=self._on_finish, meta=flight)
        self.loop.after(self.cfg.profile.request_overhead_s / 2, self._route, req)

    def _route(self, req: SimRequest) -> None:
        flight: _Flight = req.meta  # type: ignore[assignment]
        hashes = flight.hashes = self._prompt_hashes(req.prompt, flight.keyed)
        req.block_hashes = hashes  # the engine's too (the same blocks: hashed once)
        self._oracle(hashes, req.num_prompt_tokens)
        self._arrivals += 1
        flight.ticket = self.router.route(req.num_prompt_tokens, hashes, req.session_key,
                                          req.max_tokens)
        if flight.ticket is None:
            req.error = "no_worker"
            self._close(req, flight)
            return
        self._touched.add(flight.ticket.endpoint.url)
        self.workers[flight.ticket.endpoint.url].add(req)

    def _prompt_hashes(self, prompt: list[int], keyed: KeyedSegment | None) -> tuple[int, ...]:
        """`hash_blocks(prompt)` (the router's chained hashes); a trace row's keyed blocks
        come hashed with the trace (`KeyedSegment.block_hashes`), at its block length."""
        bs = self.cfg.profile.block_size
        if keyed is None or keyed.block_len != bs:
            return tuple(hash_blocks(prompt, bs))
        hashes = keyed.block_hashes
        if len(hashes) == len(prompt) // bs:
            return hashes
        out = list(hashes)  # full blocks past the row's hash ids: from their tokens
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), len(prompt) // bs):
            parent = hash_block(parent, prompt[i * bs:(i + 1) * bs])
            out.append(parent)
        return tuple(out)

    def _oracle(self, hashes: tuple[int, ...], num_tokens: int) -> None:
        """One infinite cache that saw every earlier request: the best hit rate possible."""
        usable = (num_tokens - 1) // self.cfg.profile.block_size
        hits = 0
        for h in hashes[:usable]:
            if h not in self._oracle_seen:
                break
            hits += 1
        self.oracle_hits += hits * self.cfg.profile.block_size
        self.oracle_queries += num_tokens
        self._oracle_seen.update(hashes)

    def _oracle_output(self, flight: _Flight, req: SimRequest) -> None:
        """The oracle caches the answer too (the engine does: a next turn resends it)."""
        bs = self.cfg.profile.block_size
        # past the hashed blocks: the prompt's tail, then the answer (`req.prompt` is the
        # engine sequence's token list, which the answer was appended to)
        tail = req.prompt[len(flight.hashes) * bs:]
        parent = flight.hashes[-1] if flight.hashes else None
        for i in range(len(tail) // bs):
            parent = hash_block(parent, tail[i * bs:(i + 1) * bs])
            self._oracle_seen.add(parent)

    def _on_first_token(self, req: SimRequest, now: float) -> None:
        """(Later tokens' ITLs go to the worker's `WorkerLatency` from the worker itself.)"""
        flight: _Flight = req.meta  # type: ignore[assignment]
        latency = self.latency[req.worker]
        latency.observe_ttft(now - req.arrival - self.cfg.profile.request_overhead_s / 2)
        if flight.ticket is not None:
            self.router.first_token(flight.ticket)
            self._touched.add(req.worker)

    def _on_finish(self, req: SimRequest) -> None:
        flight: _Flight = req.meta  # type: ignore[assignment]
        if flight.ticket is not None:
            self.router.finished(flight.ticket)
            self._touched.add(req.worker)
        self._oracle_output(flight, req)
        self._close(req, flight)
        url = req.worker
        if url in self.draining and self.workers[url].idle:
            self._retire(url)

    def _close(self, req: SimRequest, flight: _Flight) -> None:
        """Fill the client's record (times as the client sees them) and go on."""
        rec, half = flight.record, self.cfg.profile.request_overhead_s / 2
        rec.error = req.error
        rec.prompt_tokens = req.num_prompt_tokens
        rec.output_tokens = len(req.output)
        # per token `t + half - start`, then `start + t`, then `b - a` pairwise: the same
        # operators on the same operands (the same floats), looped in C
        start, add, sub = repeat(rec.start), operator.add, operator.sub
        times = list(map(sub, map(add, req.token_times, repeat(half)), start))
        rec.token_times = list(map(add, start, times))
        if times:
            rec.ttft = times[0]
            rec.itls = list(map(sub, times[1:], times))
        rec.e2e = (times[-1] if times else self.loop.now - rec.start) + half
        self.records.append(rec)
        if rec.ttft is not None:
            self._ttfts.append(rec.ttft)
        session, k = flight.session, flight.turn
        if rec.ok and k + 1 < len(session.turns):
            answers = [*flight.answers, req.output]
            self.loop.after(half, lambda: self._send(session, k + 1, answers))
            return
        self._session_done()

    def _session_done(self) -> None:
        self._outstanding -= 1
        self._active -= 1
        if self._pending:
            self._active += 1
            self._send(self._pending.popleft(), 0, [])

    # -- the router's scrape -----------------------------------------------------------
    def _scrape(self) -> None:
        """The gauges of every serving worker that changed since its last scrape (engine
        state, or the router's own accounting) go to the router. The others are skipped:
        the router would compute the same state again, and most of a large pool is idle
        at any interval."""
        changed = sorted(self._touched.intersection(self.serving))
        self._touched.clear()
        loads = []
        for url in changed:
            w = self.workers[url]
            bm = w.block_manager
            loads.append((url, WorkerLoad(w.num_running, w.num_waiting, bm.usage,
                                          bm.prefix_queries, bm.prefix_hits)))
        self.router.scrape(loads)
        if self._busy():
            self.loop.after(self.cfg.router.scrape_interval_s, self._scrape)

    # -- the planner -------------------------------------------------------------------
    def _plan(self) -> None:
        """One control step, in the production controller's order: (scrape the workers'
        latency histograms and read the pool's signals, when the planner asks,) decide,
        reconcile."""
        now, serving = self.loop.now, [self.workers[u] for u in self.serving]
        ttfts, self._ttfts = self._ttfts, []
        waiting = running = 0
        usage: float = 0  # summed as sum() does (from int 0): the same float
        for w in serving:  # one pass over the pool (every tick, 1,000 workers)
            sched = w.scheduler
            waiting += len(sched.waiting)
            running += len(sched.running)
            usage += w.block_manager.usage
        obs = PoolObservation(
            now=now, replicas=len(serving), starting=len(self.cold),
            waiting=waiting, running=running, kv_usage=usage / max(1, len(serving)),
            arrivals=self._arrivals,
            ttfts=ttfts,
            read_signals=self._signals)
        self._arrivals = 0
        self._resize(self.planner.desired_replicas(obs))
        self.replicas.append((now, len(self.serving), len(self.cold), len(self.draining)))
        if self._busy():
            self.loop.after(self.cfg.planner_interval_s, self._plan)

    def _signals(self) -> PoolSignals:
        """Scrape every worker's latency histograms into the window (ready and draining,
        as the controller scrapes its workers), then the pool's signals."""
        now, scraped = self.loop.now, [*self.serving, *sorted(self.draining)]
        for url in scraped:
            self.window.observe(url, now, self.latency[url].snapshot())
        self.window.forget(scraped)
        return pool_signals(MODEL, self.router.pool, self.no_buffer, len(self.cold),
                            self.window)

    def _resize(self, desired: int) -> None:
        """Start workers, or (as the controller reconciles) cancel starting ones, newest
        first, then drain the serving ones with the least in flight."""
        desired = max(1, desired)
        if desired != self.desired:
            self.scale_events += 1
            self.desired = desired
        have = len(self.serving) + len(self.cold)
        for _ in range(desired - have):
            self._start_worker(cold=True)
        excess = have - desired
        while excess > 0 and self.cold:
            self.lifetimes[self.cold.pop()][1] = self.loop.now
            excess -= 1
        if excess <= 0:  # every tick of a steady pool: no sort of the whole pool
            return
        pool = self.router.pool
        drain = sorted(self.serving, key=lambda u: (pool.get(u).inflight, u))[:excess]
        for url in drain:
            self.serving.remove(url)
            self.draining.add(url)
            self.router.drain_worker(url)
            if self.workers[url].idle:
                self._retire(url)

    def _start_worker(self, cold: bool) -> None:
        url = f"http://sim-worker-{self._next_worker:05d}"
        self._next_worker += 1
        self.lifetimes[url] = [self.loop.now, float("inf")]
        if cold:
            self.cold.append(url)
            self.loop.after(self.cfg.cold_start_s, self._worker_ready, url)
        else:
            self._worker_ready(url, cold=False)

    def _worker_ready(self, url: str, cold: bool = True) -> None:
        if cold:
            if url not in self.cold:
                return  # cancelled during its cold start
            self.cold.remove(url)
        latency = self.latency[url] = WorkerLatency()
        self.workers[url] = SimWorker(url, self.cfg.profile, self.loop, self.router.kv_events,
                                      self._touched, self.cfg.scheduling_policy, latency,
                                      self._host)
        self.router.add_worker(url)
        self.serving.append(url)

    def _retire(self, url: str) -> None:
        self.draining.discard(url)
        self.router.remove_worker(url)
        self.lifetimes[url][1] = self.loop.now

    # -- results -----------------------------------------------------------------------
    def _summary(self, end: float, wall_s: float) -> dict[str, Any]:
        workers = list(self.workers.values())
        queries = sum(w.block_manager.prefix_queries for w in workers)
        hits = sum(w.block_manager.prefix_hits for w in workers)
        per_worker = [w.num_requests for w in workers]
        mean = sum(per_worker) / max(1, len(per_worker))
        oracle = self.oracle_hits / self.oracle_queries if self.oracle_queries else None
        hit_rate = hits / queries if queries else None
        worker_s = sum(b - a for a, b in self.lifetimes.values())
        out: dict[str, Any] = {"base_url": self.cfg.label or f"sim:{self.cfg.router.policy}",
                               "model": self.cfg.profile.name}
        out |= summarize(self.records, end, self.cfg.slos)
        out |= {
            "server_prefix_cache_queries": queries,
            "server_prefix_cache_hits": hits,
            "server_prefix_cache_hit_rate": hit_rate,
            "server_num_preemptions": sum(w.scheduler.num_preemptions for w in workers),
            "oracle_prefix_cache_hit_rate": oracle,
            "hit_rate_vs_oracle": hit_rate / oracle if hit_rate is not None and oracle else None,
            "policy": self.cfg.router.policy,
            "workers_initial": self.cfg.workers,
            "worker_hours": worker_s / 3600.0,
            "worker_seconds": worker_s,
            "scale_events": self.scale_events,
            "replicas_over_time": [{"t": t, "replicas": n, "starting": s, "draining": d}
                                   for t, n, s, d in self.replicas],
            "per_worker_requests": per_worker,
            "busiest_over_mean": max(per_worker) / mean if mean else None,
            "mean_worker_busy": (sum(w.busy_seconds for w in workers) / max(end, 1e-9)
                                 / max(1, len(workers))),
            "engine_steps": sum(w.num_steps for w in workers),
            "events": self.loop.events_run,
            "wall_s": wall_s,
            "events_per_s": self.loop.events_run / max(wall_s, 1e-9),
        }
        if "good_requests" in out:  # issue 12's measure: requests meeting the SLO per
            out["goodput_per_worker_s"] = out["good_requests"] / max(worker_s, 1e-9)
            out["slo_attainment"] = out["good_requests"] / max(1, len(self.records))
        return out
