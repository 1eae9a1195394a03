"""Overload: 3x a pool's capacity, with and without the router's admission queue.

Three kinds of process: stub workers with an exact capacity (each serves at most
`--capacity` requests at once, FIFO, each holding its slot `--service` seconds, the
first token after `--ttft`), `sluice router` in front of them, and this client (open
loop, seeded Poisson arrivals, streamed requests, TTFT at the first SSE chunk). Pool
capacity = workers x capacity / service requests per second.

Two scenarios, each against two routers in the same run: `queue` (the admission queue,
`--max-inflight-per-worker` = the stubs' capacity, so the router holds what the workers
cannot start) and `direct` (`--max-inflight-per-worker 0`: every request goes to a
worker and waits in its FIFO, as before this queue existed):

1. bands: tenant `hi` (priority 0) offers 0.5x capacity, tenant `lo` (priority 2)
   2.5x: the high band's TTFT p90 against `--slo`, the low band's queue wait and
   shedding (429 band full, 503 wait timed out);
2. fair: tenants `a` (2x capacity) and `b` (1x), one band, equal weights: their shares
   of the requests served (fair: half each, as both want more than half; a FIFO gives
   them 2:1, in proportion to what they send).

    flock /tmp/sluice-heavy.lock timeout 600 .venv/bin/python benchmarks/overload.py

`--fast-path` measures instead what flow control adds to a request that need not wait
(in process, no HTTP): `admission.admit` with room and nobody queued, and the proxy's
retry-budget count and breaker check.

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.control.local import free_port

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
EVENT = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
BODY = {"model": "stub", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def stub_app(capacity: int, ttft_s: float, service_s: float) -> Any:
    """A worker that serves `capacity` streams at once (FIFO), each `service_s` long."""
    slots = asyncio.Semaphore(capacity)

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path != "/v1/chat/completions":
            body = MODELS if path == "/v1/models" else b"ok"
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        while (await receive()).get("more_body"):
            pass
        work = asyncio.create_task(generate(send))
        gone = asyncio.ensure_future(receive())  # http.disconnect: abort, as an engine does
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        work.cancel()
        gone.cancel()

    async def generate(send: Send) -> None:
        async with slots:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await asyncio.sleep(ttft_s)
            await send({"type": "http.response.body", "body": EVENT, "more_body": True})
            await asyncio.sleep(service_s - ttft_s)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def run_stubs(ports: list[int], capacity: int, ttft_s: float, service_s: float) -> None:
    import uvicorn

    async def main() -> None:
        servers = [uvicorn.Server(uvicorn.Config(stub_app(capacity, ttft_s, service_s),
                                                 host="127.0.0.1", port=p, log_level="error",
                                                 lifespan="off")) for p in ports]
        await asyncio.gather(*(s.serve() for s in servers))

    asyncio.run(main())


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    ok: int = 0
    status: dict[int, int] = field(default_factory=dict)
    timeouts: int = 0
    finished: list[float] = field(default_factory=list)  # seconds since the run's start


async def one(c: httpx.AsyncClient, headers: dict[str, str], result: Result,
              deadline_s: float, run_start: float) -> None:
    start = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s), \
                c.stream("POST", "/v1/chat/completions", json=BODY, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                result.status[r.status_code] = result.status.get(r.status_code, 0) + 1
                return
            first = None
            async for _ in r.aiter_bytes():
                first = first or time.perf_counter() - start
            if first is not None:
                result.ttft.append(first)
            result.ok += 1
            result.finished.append(time.perf_counter() - run_start)
    except TimeoutError:
        result.timeouts += 1


async def offer(base: str, rates: dict[str, tuple[float, int]], duration_s: float,
                deadline_s: float, seed: int) -> dict[str, Result]:
    """Poisson arrivals per tenant: {tenant: (req/s, priority)}; waits for all to end."""
    results = {t: Result() for t in rates}
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=None) as c:
        tasks: list[asyncio.Task[None]] = []
        rng = random.Random(seed)
        arrivals = sorted((t0, tenant) for tenant, (rate, _) in rates.items()
                          for t0 in _poisson(rng, rate, duration_s))
        start = time.perf_counter()
        for t0, tenant in arrivals:
            await asyncio.sleep(max(0.0, start + t0 - time.perf_counter()))
            headers = {"x-sluice-tenant": tenant, "x-sluice-priority": str(rates[tenant][1])}
            tasks.append(asyncio.create_task(one(c, headers, results[tenant], deadline_s,
                                                 start)))
        await asyncio.gather(*tasks)
    return results


def _poisson(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < duration_s:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def start_router(workers: list[str], port: int, inflight: int, args: argparse.Namespace
                 ) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sluice.cli", "router", "--port", str(port), "--model", "stub",
           "--policy", "least_load", "--log-level", "warning",
           "--max-inflight-per-worker", str(inflight),
           "--queue-timeout", str(args.queue_timeout), "--queue-capacity", str(args.queue_capacity)]
    for w in workers:
        cmd += ["--worker", w]
    return subprocess.Popen(cmd)


def wait_up(url: str) -> None:
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def summary(r: Result, duration_s: float) -> dict[str, Any]:
    """`ok_overloaded`: requests finished in the last 3/4 of the offered load, when
    every queue is backlogged (the shares are counted there)."""
    return {"ok": r.ok, "status": {str(k): v for k, v in sorted(r.status.items())},
            "client_timeouts": r.timeouts, "ttft_p50_s": pct(r.ttft, 50),
            "ttft_p90_s": pct(r.ttft, 90),
            "ok_overloaded": sum(duration_s / 4 <= t <= duration_s for t in r.finished)}


async def fast_path(n: int = 200_000) -> dict[str, float]:
    """Microseconds per request of the admission fast path and the breaker checks."""
    from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
    from sluice.router.state import RouterState

    workers = tuple(WorkerSpec(f"http://127.0.0.1:{9000 + i}") for i in range(4))
    state = RouterState(RouterConfig(pools=(PoolConfig(model="m", workers=workers),)),
                        random.Random(0))
    pool = state.pools[0]
    headers = [(b"content-type", b"application/json"), (b"x-sluice-priority", b"1"),
               (b"x-sluice-tenant", b"acme"), (b"accept", b"*/*")]
    start = time.perf_counter()
    for _ in range(n):
        await state.admission.admit(pool, headers)
    admit_us = (time.perf_counter() - start) / n * 1e6
    budget = state.breakers.budget(pool)
    start = time.perf_counter()
    for _ in range(n):
        budget.request()
        state.breakers.blocked(pool).update(())
    breaker_us = (time.perf_counter() - start) / n * 1e6
    await state.close()
    return {"admit_us": admit_us, "budget_and_breaker_us": breaker_us}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--capacity", type=int, default=4, help="concurrent requests per worker")
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--service", type=float, default=0.25, help="seconds a request holds a slot")
    p.add_argument("--overload", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of offered load")
    p.add_argument("--slo", type=float, default=0.5, help="the high band's TTFT p90 target")
    p.add_argument("--queue-timeout", type=float, default=3.0)
    p.add_argument("--queue-capacity", type=int, default=200)
    p.add_argument("--deadline", type=float, default=10.0, help="client gives up after (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fast-path", action="store_true",
                   help="measure flow control's cost per unqueued request instead")
    p.add_argument("--stub-ports", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fast_path:
        cost = asyncio.run(fast_path())
        print(f"admission fast path {cost['admit_us']:.2f} us/request, retry budget + "
              f"breaker check {cost['budget_and_breaker_us']:.2f} us/request")
        print(json.dumps(cost))
        return
    if args.stub_ports:
        run_stubs([int(x) for x in args.stub_ports.split(",")], args.capacity, args.ttft,
                  args.service)
        return
    capacity = args.workers * args.capacity / args.service
    ports = [free_port() for _ in range(args.workers)]
    stubs = subprocess.Popen([sys.executable, __file__, "--stub-ports", ",".join(map(str, ports)),
                              "--capacity", str(args.capacity), "--ttft", str(args.ttft),
                              "--service", str(args.service)])
    workers = [f"http://127.0.0.1:{p}" for p in ports]
    routers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
    try:
        for w in workers:
            wait_up(w)
        for name, inflight in (("queue", args.capacity), ("direct", 0)):
            port = free_port()
            routers[name] = (f"http://127.0.0.1:{port}",
                             start_router(workers, port, inflight, args))
            wait_up(routers[name][0])
        total = args.overload * capacity
        scenarios = {"bands": {"hi": (total / 6, 0), "lo": (total * 5 / 6, 2)},
                     "fair": {"a": (total * 2 / 3, 1), "b": (total / 3, 1)}}
        out: dict[str, Any] = {"capacity_rps": capacity, "offered_rps": total,
                               "slo_ttft_p90_s": args.slo, "args": vars(args)}
        for scenario, rates in scenarios.items():
            for name, (url, _) in routers.items():
                asyncio.run(offer(url, rates, 1.0, args.deadline, args.seed + 1))  # warm-up
                time.sleep(2 * args.service + 0.5)
                res = asyncio.run(offer(url, rates, args.duration, args.deadline, args.seed))
                out[f"{scenario}/{name}"] = {t: summary(r, args.duration)
                                             for t, r in res.items()}
                time.sleep(args.deadline / 2)  # let the direct run's backlog drain
        report(out)
    finally:
        for _, proc in routers.values():
            proc.terminate()
            proc.wait(10)
        stubs.terminate()
        stubs.wait(10)


def report(out: dict[str, Any]) -> None:
    print(f"pool capacity {out['capacity_rps']:.0f} req/s, offered {out['offered_rps']:.0f} "
          f"req/s; high band TTFT p90 SLO {out['slo_ttft_p90_s']} s")
    print(f"{'run':<14}{'tenant':<8}{'ok':>6}{'429':>6}{'503':>6}{'gave up':>9}"
          f"{'TTFT p50':>10}{'TTFT p90':>10}")
    for key, tenants in out.items():
        if "/" not in key:
            continue
        for tenant, s in tenants.items():
            p50 = f"{s['ttft_p50_s']:.3f}" if s["ttft_p50_s"] is not None else "-"
            p90 = f"{s['ttft_p90_s']:.3f}" if s["ttft_p90_s"] is not None else "-"
            print(f"{key:<14}{tenant:<8}{s['ok']:>6}{s['status'].get('429', 0):>6}"
                  f"{s['status'].get('503', 0):>6}{s['client_timeouts']:>9}{p50:>10}{p90:>10}")
    for name in ("queue", "direct"):
        fair = out.get(f"fair/{name}")
        if fair:
            a, b = fair["a"]["ok_overloaded"], fair["b"]["ok_overloaded"]
            share = a / (a + b) if a + b else 0.0
            out.setdefault("fair_share_a", {})[name] = share
            print(f"fair/{name}: tenant a (sends 2/3) served {share:.1%} of {a + b} "
                  "(equal weights)")
        hi = out.get(f"bands/{name}", {}).get("hi")
        if hi and hi["ttft_p90_s"] is not None:
            met = hi["ttft_p90_s"] <= out["slo_ttft_p90_s"]
            print(f"bands/{name}: high band TTFT p90 {hi['ttft_p90_s']:.3f} s "
                  f"({'meets' if met else 'misses'} the SLO)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
