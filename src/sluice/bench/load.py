"""When requests leave: arrival processes, a concurrency cap, a duration limit.

Arrivals follow vLLM's benchmark_serving: inter-arrival gaps drawn from a gamma
distribution with shape `burstiness` and mean `1 / request_rate` (burstiness 1 is a
Poisson process; < 1 burstier, > 1 more regular); `request_rate = inf` sends
everything at t = 0. A trace brings its own arrival times instead.

The dispatcher walks the sessions in order, sleeps until each one's arrival, then
takes a slot (`--max-concurrency`, FIFO: a late session waits for a free slot, as
vLLM's semaphore does) and starts it. A session sends its turns one after another,
each turn's prompt carrying the earlier answers. With `--duration`, no session starts
after the deadline; the ones already running finish and are counted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from sluice.bench.client import History, RequestRecord, StreamingClient
from sluice.bench.workloads import Session
from sluice.protocol.errors import InvalidRequestError

_ARRIVALS = 9  # numpy stream for arrival gaps, apart from the workload's streams


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    duration: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise InvalidRequestError("request_rate must be > 0 (or inf)", param="request_rate")
        if not 0 < self.burstiness < math.inf:
            raise InvalidRequestError("burstiness must be > 0 and finite", param="burstiness")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequestError("max_concurrency must be >= 1", param="max_concurrency")
        if self.duration is not None and not 0 < self.duration < math.inf:
            raise InvalidRequestError("duration must be > 0 and finite", param="duration")


def check_burstiness(request_rate: float, burstiness: float | None) -> None:
    """A given `--burstiness` needs a finite rate (`bench serve` and `sim` alike): with
    every request at t=0 there are no gaps for its gamma shape to change."""
    if burstiness is not None and not math.isfinite(request_rate):
        raise InvalidRequestError("--burstiness shapes the gaps between arrivals: it needs a "
                                  "finite --request-rate (inf sends everything at once)",
                                  param="burstiness")


def arrival_times(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Offsets in seconds of successive arrivals: 0, g1, g1+g2, ... (gamma gaps)."""
    if math.isinf(rate):
        while True:
            yield 0.0
    rng = np.random.default_rng([seed, _ARRIVALS])
    theta = 1.0 / (rate * burstiness)
    t = 0.0
    while True:
        yield t
        t += float(rng.gamma(shape=burstiness, scale=theta))


def schedule(
    sessions: Iterable[Session], cfg: LoadConfig, use_trace_times: bool
) -> Iterator[tuple[Session, float]]:
    """Pair each session with its start offset (its own trace time, or a drawn arrival)."""
    if use_trace_times:
        return ((s, s.arrival or 0.0) for s in sessions)
    return zip(sessions, arrival_times(cfg.request_rate, cfg.burstiness, cfg.seed), strict=False)


async def run_session(
    client: StreamingClient, session: Session, t0: float, on_done: Callable[[RequestRecord], None]
) -> list[RequestRecord]:
    """Send a session's turns in order; stop at the first failed turn."""
    history: History = []
    records = []
    for k, turn in enumerate(session.turns):
        rec = await client.send(session, k, history, t0)
        records.append(rec)
        on_done(rec)
        if not rec.ok:
            break
        history.append((turn.user, rec.text))
    return records


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float  # from t0 until the last request finished
    started_at: float  # wall-clock time.time() at t0


async def run_load(
    client: StreamingClient,
    timed: Iterable[tuple[Session, float]],
    cfg: LoadConfig,
    on_done: Callable[[RequestRecord], None] = lambda _r: None,
) -> RunResult:
    """Dispatch sessions at their offsets under the concurrency cap; gather every record."""
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    wall, t0 = time.time(), time.perf_counter()
    tasks: list[asyncio.Task[list[RequestRecord]]] = []

    async def one(session: Session) -> list[RequestRecord]:
        try:
            return await run_session(client, session, t0, on_done)
        finally:
            if slots:
                slots.release()

    for session, at in timed:
        if _past(cfg.duration, at):
            break
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots:
            await slots.acquire()
        if _past(cfg.duration, time.perf_counter() - t0):
            if slots:
                slots.release()
            break
        tasks.append(asyncio.create_task(one(session)))
    done = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    return RunResult([r for recs in done for r in recs], duration, wall)


def _past(duration: float | None, offset: float) -> bool:
    return duration is not None and offset >= duration
