"""Adapter-aware routing under a skewed (Zipf) adapter mix: sluice vs "route where loaded" vs round robin.

    flock /tmp/sluice-heavy.lock python benchmarks/lora_routing.py   # PYTHONPATH=src:.

Workers: 3 LoRA stub workers (tests/router/lora_stub.py), not engines: each keeps the
weights of `--max-loras` adapters (LRU); a request whose adapter is not among them
first waits `--load-s` (reading the weights), then runs `--service-s` in one of
`--max-num-seqs` slots. So the numbers are about placement (which worker, how many
weight loads), not model speed; a stub has no model. Same seeded workload (Poisson
arrivals at `--rate`, adapters drawn Zipf(`--zipf`) over `--adapters`) for each policy,
in one run:

    sluice         router with the adapters registered (router/adapters.py): loads on
                   demand, replicates a hot adapter up to --max-adapter-replicas when its
                   holders' queue costs more than a load, evicts only idle adapters
    where-loaded   every adapter registered on every worker; the client picks, with the
                   stubs' exact state (fresher than any scrape: generous), the least
                   loaded worker whose loaded weights include the adapter, else the
                   least loaded worker (llm-d's LoRA affinity)
    round-robin    every adapter registered on every worker; router round_robin

Reported: weight loads per 1,000 requests (the stubs' LRU misses, what costs time),
router load calls per 1,000 (sluice only), TTFT p50/p90/p99 (client: request sent to
the first streamed byte). Last line: one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import httpx  # noqa: E402
from tests.router.lora_stub import LoraStub, chat  # noqa: E402
from tests.router.router_stubs import serve, serve_router  # noqa: E402

from sluice.router.app import build_app  # noqa: E402
from sluice.router.config import (  # noqa: E402
    AdapterPlacement,
    AdapterSpec,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
)


def workload(args: argparse.Namespace) -> list[tuple[float, str]]:
    rng = random.Random(args.seed)
    names = [f"lora{i}" for i in range(args.adapters)]
    weights = [1 / (i + 1) ** args.zipf for i in range(args.adapters)]
    t, out = 0.0, []
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        out.append((t, rng.choices(names, weights)[0]))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def drive(jobs: list[tuple[float, str]], send: Callable[[str], Awaitable[float]]
                ) -> list[float]:
    start = time.perf_counter()

    async def one(at: float, name: str) -> float:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        return await send(name)

    return list(await asyncio.gather(*(one(at, n) for at, n in jobs)))


async def ttft(client: httpx.AsyncClient, url: str, name: str) -> float:
    t0 = time.perf_counter()
    body = chat(name, words=32, salt=random.randrange(1 << 30), stream=True)  # no shared prefix
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        first = None
        async for _ in r.aiter_bytes():
            if first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def run_policy(policy: str, args: argparse.Namespace,
                     jobs: list[tuple[float, str]]) -> dict[str, Any]:
    names = sorted({n for _, n in jobs} | {f"lora{i}" for i in range(args.adapters)})
    stubs = [LoraStub(f"w{i}", max_loras=args.max_loras, load_s=args.load_s,
                      service_s=args.service_s, max_num_seqs=args.max_num_seqs)
             for i in range(args.workers)]
    if policy != "sluice":
        for s in stubs:
            s.adapters.update({n: f"/adapters/{n}" for n in names})  # --lora-modules
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(s.app())) for s in stubs]
        specs = tuple(AdapterSpec(n, f"/adapters/{n}") for n in names) if policy == "sluice" \
            else ()
        config = RouterConfig(
            pools=(PoolConfig(model="base", workers=tuple(WorkerSpec(u) for u in urls),
                              policy="round_robin" if policy == "round-robin" else "cost"),),
            adapters=specs, seed=args.seed, scrape_interval_s=0.25, health_interval_s=1.0,
            adapter_placement=AdapterPlacement(max_adapter_replicas=args.max_adapter_replicas,
                                               load_s=args.load_s, sync_interval_s=1.0))
        app = build_app(config, rng=random.Random(args.seed))
        router = await stack.enter_async_context(serve_router(app))
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=120, limits=limits))
        by_url = dict(zip(urls, stubs, strict=True))

        async def via_router(name: str) -> float:
            return await ttft(client, router, name)

        async def where_loaded(name: str) -> float:
            holders = [u for u, s in by_url.items() if name in s.weights] or list(by_url)
            url = min(holders, key=lambda u: (by_url[u].running + by_url[u].waiting, u))
            return await ttft(client, url, name)

        send = where_loaded if policy == "where-loaded" else via_router
        warm = jobs[: args.warmup]
        await drive([(i * 0.01, n) for i, (_, n) in enumerate(warm)], send)
        before = sum(s.weight_loads for s in stubs)
        router_before = app.state.router.adapters.counts.total_loads()
        times = await drive(jobs, send)
        weight_loads = sum(s.weight_loads for s in stubs) - before
        router_loads = app.state.router.adapters.counts.total_loads() - router_before
        n = len(times)
        return {"policy": policy, "requests": n,
                "weight_loads_per_1k": round(1000 * weight_loads / n, 1),
                "router_loads_per_1k": round(1000 * router_loads / n, 1),
                "ttft_p50_ms": round(1000 * percentile(times, 0.5), 1),
                "ttft_p90_ms": round(1000 * percentile(times, 0.9), 1),
                "ttft_p99_ms": round(1000 * percentile(times, 0.99), 1),
                "served_per_worker": [len(s.served) for s in stubs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rate", type=float, default=90.0, help="requests per second")
    ap.add_argument("--max-loras", type=int, default=2)
    ap.add_argument("--max-adapter-replicas", type=int, default=2)
    ap.add_argument("--load-s", type=float, default=0.1)
    ap.add_argument("--service-s", type=float, default=0.05)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="sluice,where-loaded,round-robin")
    args = ap.parse_args()
    jobs = workload(args)
    results = [asyncio.run(run_policy(p, args, jobs)) for p in args.policies.split(",")]
    print(f"{'policy':<14}{'weight loads/1k':>16}{'router loads/1k':>16}"
          f"{'TTFT p50':>10}{'p90':>9}{'p99':>9}  per worker")
    for r in results:
        print(f"{r['policy']:<14}{r['weight_loads_per_1k']:>16}{r['router_loads_per_1k']:>16}"
              f"{r['ttft_p50_ms']:>10}{r['ttft_p90_ms']:>9}{r['ttft_p99_ms']:>9}  "
              f"{r['served_per_worker']}")
    print(json.dumps({"benchmark": "lora_routing", "cpu": platform.processor() or platform.machine(),
                      "cores": os.cpu_count(), "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
