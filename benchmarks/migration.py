"""Mid-stream migration under worker kills: failed client streams and added latency.

    3 local workers behind an in-process router (`sluice router`'s server); C clients
    stream completions in a loop; every --kill-every seconds one worker is killed with
    SIGKILL and started again on its port. Run once with --migration-limit N, then the
    same workload with migration off (the peer), each for --minutes.

A stream fails when it errors, breaks, or ends without [DONE] or with fewer than
max_tokens tokens. Streams in flight at a kill are "hit"; their latency against the
others' is what migration adds. The last stdout line is one JSON document.

    python benchmarks/migration.py --model /path/to/model --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.control.local import LocalWorkerPool, child_command
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
from sluice.router.server import RouterServer


@dataclass
class Phase:
    limit: int
    ok: list[tuple[float, float, float]] = field(default_factory=list)  # start, end, s
    failed: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # why streams failed
    kills: list[float] = field(default_factory=list)
    migrations: float = 0.0

    def summary(self) -> dict[str, Any]:
        hit = [d for s, e, d in self.ok if any(s <= k <= e for k in self.kills)]
        clean = [d for s, e, d in self.ok if not any(s <= k <= e for k in self.kills)]
        return {"migration_limit": self.limit, "requests": len(self.ok) + self.failed,
                "failed": self.failed, "kills": len(self.kills), "migrations": self.migrations,
                "hit_streams": len(hit), "p50_s_hit": _p50(hit), "p50_s_clean": _p50(clean),
                "max_s_hit": round(max(hit), 3) if hit else None, "reasons": self.reasons}


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


async def one_stream(c: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str | None:
    """None when the stream was whole, else why not."""
    try:
        async with c.stream("POST", url + "/v1/completions", json=body) as s:
            if s.status_code != 200:
                return f"status {s.status_code}"
            lines = [ln async for ln in s.aiter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError as exc:
        return type(exc).__name__
    if not lines or lines[-1] != "data: [DONE]":
        return "no [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    if any("error" in ch for ch in chunks):
        return "error event"
    if chunks[-1]["usage"]["completion_tokens"] != body["max_tokens"]:
        return "short"
    return None


async def client(url: str, phase: Phase, end: float, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as c:
        while time.monotonic() < end:
            body = {"model": "m", "prompt": f"Story {rng.randrange(10**6)}:", "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                    "stream_options": {"include_usage": True}}
            start = time.monotonic()
            failure = await one_stream(c, url, body)
            if failure is None:
                phase.ok.append((start, time.monotonic(), time.monotonic() - start))
            else:
                phase.failed += 1
                phase.reasons[failure] = phase.reasons.get(failure, 0) + 1
                await asyncio.sleep(0.1)  # a failing client does not spin


def restart(pool: LocalWorkerPool, index: int, args: list[str]) -> None:
    """SIGKILL worker `index` and start it again on its port (the model loads meanwhile)."""
    w = pool.workers[index]
    w.process.send_signal(signal.SIGKILL)
    w.process.wait()
    cmd = [*child_command(), "worker", *args, "--host", "127.0.0.1", "--port", str(w.port)]
    with open(w.log_path, "ab") as log:
        w.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)


async def run_phase(pool: LocalWorkerPool, args: argparse.Namespace, worker_args: list[str],
                    limit: int) -> Phase:
    phase = Phase(limit)
    specs = tuple(WorkerSpec(u) for u in pool.urls)
    config = RouterConfig(pools=(PoolConfig(model="m", workers=specs, policy="least_load"),),
                          migration_limit=limit, health_interval_s=0.5, seed=0)
    async with RouterServer(build_app(config), "127.0.0.1", 0, shutdown_timeout_s=5) as server:
        await asyncio.sleep(1.0)  # first health probes
        end = time.monotonic() + args.minutes * 60
        clients = [asyncio.create_task(client(server.url, phase, end, args.max_tokens, i))
                   for i in range(args.concurrency)]
        victim = 0
        while time.monotonic() + args.kill_every < end:
            await asyncio.sleep(args.kill_every)
            phase.kills.append(time.monotonic())
            restart(pool, victim % len(pool.workers), worker_args)
            victim += 1
        await asyncio.gather(*clients)
        async with httpx.AsyncClient() as c:
            text = (await c.get(server.url + "/metrics")).text
        phase.migrations = sum(float(ln.split()[-1]) for ln in text.splitlines()
                               if ln.startswith("sluice_router_migrations_total"))
    return phase


async def main_async(args: argparse.Namespace) -> None:
    worker_args = ["--model", args.model, "--served-model-name", "m", *args.worker_arg]
    with LocalWorkerPool(3, worker_args, startup_timeout_s=300) as pool:
        results = []
        for limit in (args.migration_limit, 0):
            phase = await run_phase(pool, args, worker_args, limit)
            results.append(phase.summary())
            await asyncio.sleep(20)  # the last restarted worker loads
    print(f"{'migration_limit':>15} {'requests':>8} {'failed':>6} {'kills':>5} "
          f"{'migrations':>10} {'p50 hit s':>9} {'p50 clean s':>11}")
    for r in results:
        print(f"{r['migration_limit']:>15} {r['requests']:>8} {r['failed']:>6} {r['kills']:>5} "
              f"{r['migrations']:>10} {r['p50_s_hit']!s:>9} {r['p50_s_clean']!s:>11}")
    print(json.dumps({"benchmark": "migration", "minutes": args.minutes,
                      "kill_every_s": args.kill_every, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "phases": results}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="model dir or .gguf for the workers")
    p.add_argument("--minutes", type=float, default=10.0, help="per phase (default 10)")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds (default 60)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--migration-limit", type=int, default=3)
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra `sluice worker` flag (repeat), e.g. --worker-arg=--dtype=float32")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
