"""Gateway overhead and limiter accuracy.

1. Overhead: a fast stub upstream (fixed OpenAI chat completion with usage) is served
   alone on one port and wrapped in `GatewayMiddleware` on another, both by uvicorn in a
   separate process. The client measures sequential latency (p50/p99) and throughput
   at a fixed concurrency against each, in interleaved rounds, so the gateway's added
   cost is a difference measured in the same run (auth lookup, prompt token count with
   the real tokenizer, limiter, ledger write).
2. Accuracy: bursts of concurrent requests against an RPM limit, through one gateway
   (in-process limiter) and through two replicas sharing Redis; admitted vs limit.

    flock /tmp/sluice-heavy.lock python benchmarks/gateway_overhead.py [--redis] [--postgres]

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from sluice.control.local import free_port

REDIS_URL = "redis://127.0.0.1:6379/0"
PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
CHAT = {"model": "stub", "max_tokens": 16,
        "messages": [{"role": "user", "content": "Summarize the plot of Hamlet in one line."}]}
_RESPONSE = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "A prince hesitates."},
                 "finish_reason": "stop", "logprobs": None}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45}}).encode()

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def stub_app(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
    """The fastest OpenAI upstream there is: read the body, answer a fixed completion."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_RESPONSE)).encode())]})
    await send({"type": "http.response.body", "body": _RESPONSE})


# -- server process -------------------------------------------------------------------------


def build_gateway(db_url: str, table_prefix: str, redis_prefix: str | None) -> tuple[Any, str]:
    from sluice.gateway.config import GatewayConfig, LimiterConfig
    from sluice.gateway.middleware import GatewayMiddleware
    from sluice.gateway.state import GatewayState
    from sluice.gateway.store import KeySettings, TenantSettings

    limiter = LimiterConfig(redis_url=REDIS_URL if redis_prefix else None,
                            key_prefix=redis_prefix or "sluice:rl:")
    state = GatewayState.from_config(GatewayConfig(database_url=db_url, table_prefix=table_prefix,
                                                   limiter=limiter))
    state.store.create_tenant("bench", TenantSettings(rpm=10**7, tpm=10**9))
    _, key = state.store.create_key("bench", KeySettings(rpm=10**7, tpm=10**9))
    state.count_prompt_tokens("stub", CHAT)  # load the tokenizer before timing
    return GatewayMiddleware(stub_app, state), key


async def serve_both(stub_port: int, gw_port: int, gateway: Any) -> None:
    import uvicorn

    servers = [uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                             log_level="error", lifespan="off",
                                             access_log=False))
               for app, port in ((stub_app, stub_port), (gateway, gw_port))]
    await asyncio.gather(*(s.serve() for s in servers))


def server_main(spec: dict[str, Any]) -> None:
    gateway, key = build_gateway(spec["db_url"], spec["table_prefix"], spec["redis_prefix"])
    print(json.dumps({"key": key}), flush=True)
    asyncio.run(serve_both(spec["stub_port"], spec["gw_port"], gateway))


# -- client ----------------------------------------------------------------------------------


async def sequential(client: httpx.AsyncClient, url: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await client.post(url, json=CHAT)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return out


async def throughput(client: httpx.AsyncClient, url: str, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            r = await client.post(url, json=CHAT)
            assert r.status_code == 200, r.text

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t0)


async def cleanup(db_url: str, table_prefix: str, redis_prefix: str | None) -> None:
    """Drop the run's tables and Redis keys."""
    from sluice.gateway.store import SQLStore

    store = SQLStore(db_url, table_prefix=table_prefix)
    store.drop_all()
    store.close()
    if redis_prefix:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in client.scan_iter(match=f"{redis_prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure_overhead(args: argparse.Namespace, label: str, db_url: str,
                           redis_prefix: str | None) -> dict[str, Any]:
    stub_port, gw_port = free_port(), free_port()
    spec = {"db_url": db_url, "table_prefix": f"b{uuid.uuid4().hex[:8]}_",
            "redis_prefix": redis_prefix, "stub_port": stub_port, "gw_port": gw_port}
    proc = subprocess.Popen([sys.executable, __file__, "--server", json.dumps(spec)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        key = json.loads(proc.stdout.readline())["key"]
        headers = {"Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=args.concurrency)
        async with httpx.AsyncClient(headers=headers, timeout=30, limits=limits) as client:
            urls = {"stub": f"http://127.0.0.1:{stub_port}/v1/chat/completions",
                    "gateway": f"http://127.0.0.1:{gw_port}/v1/chat/completions"}
            for url in urls.values():  # wait for both, then warm up
                for _ in range(200):
                    try:
                        await client.post(url, json=CHAT)
                        break
                    except httpx.TransportError:
                        await asyncio.sleep(0.05)
                await sequential(client, url, args.warmup)
            lat: dict[str, list[float]] = {"stub": [], "gateway": []}
            rps: dict[str, list[float]] = {"stub": [], "gateway": []}
            for _ in range(args.rounds):
                for name, url in urls.items():
                    lat[name] += await sequential(client, url, args.requests // args.rounds)
                    rps[name].append(await throughput(client, url, args.burst, args.concurrency))
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        await cleanup(db_url, spec["table_prefix"], redis_prefix)
    result: dict[str, Any] = {"config": label}
    for name in ("stub", "gateway"):
        result[f"{name}_p50_ms"] = 1000 * statistics.median(lat[name])
        result[f"{name}_p99_ms"] = 1000 * pct(lat[name], 0.99)
        result[f"{name}_rps"] = statistics.median(rps[name])
    result["added_p50_ms"] = result["gateway_p50_ms"] - result["stub_p50_ms"]
    result["added_p99_ms"] = result["gateway_p99_ms"] - result["stub_p99_ms"]
    result["rps_ratio"] = result["gateway_rps"] / result["stub_rps"]
    return result


async def measure_accuracy(limit: int, burst: int, redis: bool, db_url: str) -> dict[str, Any]:
    from sluice.gateway.config import GatewayConfig
    from sluice.gateway.limits import Limiter, LocalLimiter, RedisLimiter
    from sluice.gateway.middleware import GatewayMiddleware
    from sluice.gateway.state import GatewayState
    from sluice.gateway.store import KeySettings, SQLStore, TenantSettings
    from sluice.gateway.tokens import estimate_prompt_tokens

    prefix = f"b{uuid.uuid4().hex[:8]}_"
    rl_prefix = f"sluice-bench:{uuid.uuid4().hex}:"
    replicas, stores = [], []
    shared_local = LocalLimiter()
    for _ in range(2 if redis else 1):
        store = SQLStore(db_url, table_prefix=prefix)
        stores.append(store)
        limiter: Limiter = RedisLimiter(REDIS_URL, prefix=rl_prefix) if redis else shared_local
        state = GatewayState(config=GatewayConfig(), store=store, limiter=limiter,
                             count_prompt_tokens=estimate_prompt_tokens)
        replicas.append(GatewayMiddleware(stub_app, state))
    stores[0].create_tenant("burst", TenantSettings(rpm=limit))
    _, key = stores[0].create_key("burst", KeySettings())
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=gw),  # type: ignore[arg-type]
                                 base_url="http://gw", headers={"Authorization": f"Bearer {key}"})
               for gw in replicas]
    responses = await asyncio.gather(*(clients[i % len(clients)].post(
        "/v1/chat/completions", json=CHAT) for i in range(burst)))
    for c in clients:
        await c.aclose()
    if redis:
        for gw in replicas:
            await gw.state.limiter.close()
    await cleanup(db_url, prefix, rl_prefix if redis else None)
    admitted = sum(r.status_code == 200 for r in responses)
    return {"limiter": "redis, 2 replicas" if redis else "local, 1 replica", "limit": limit,
            "burst": burst, "admitted": admitted,
            "refused_429": sum(r.status_code == 429 for r in responses)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="sluice-gw-bench-")
    sqlite_url = f"sqlite:///{os.path.join(tmp, 'bench.db')}"
    overhead = ([] if args.accuracy_only else
                [await measure_overhead(args, "sqlite + local limiter", sqlite_url, None)])
    if (args.redis or args.postgres) and not args.accuracy_only:
        db = PG_URL if args.postgres else sqlite_url
        label = ("postgres" if args.postgres else "sqlite") + (" + redis" if args.redis
                                                               else " + local limiter")
        overhead.append(await measure_overhead(args, label, db,
                                               f"sluice-bench:{uuid.uuid4().hex}:"
                                               if args.redis else None))
    accuracy = [await measure_accuracy(args.limit, args.limit * 4, False, sqlite_url)]
    if args.redis:
        accuracy.append(await measure_accuracy(args.limit, args.limit * 4, True,
                                               PG_URL if args.postgres else sqlite_url))
    return {"overhead": overhead, "accuracy": accuracy, "requests": args.requests,
            "concurrency": args.concurrency, "burst": args.burst}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'config':28} {'stub p50':>9} {'gw p50':>9} {'+p50':>7} {'stub p99':>9} "
          f"{'gw p99':>9} {'+p99':>7} {'stub rps':>9} {'gw rps':>9} {'ratio':>6}")
    for r in result["overhead"]:
        print(f"{r['config']:28} {r['stub_p50_ms']:9.2f} {r['gateway_p50_ms']:9.2f} "
              f"{r['added_p50_ms']:7.2f} {r['stub_p99_ms']:9.2f} {r['gateway_p99_ms']:9.2f} "
              f"{r['added_p99_ms']:7.2f} {r['stub_rps']:9.0f} {r['gateway_rps']:9.0f} "
              f"{r['rps_ratio']:6.2f}")
    print()
    print(f"{'limiter':20} {'limit':>6} {'burst':>6} {'admitted':>9} {'429':>5}")
    for a in result["accuracy"]:
        print(f"{a['limiter']:20} {a['limit']:6} {a['burst']:6} {a['admitted']:9} "
              f"{a['refused_429']:5}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per target")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--burst", type=int, default=200, help="requests per throughput burst")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--limit", type=int, default=100, help="RPM limit for the accuracy burst")
    parser.add_argument("--redis", action="store_true", help="also measure with Redis limits")
    parser.add_argument("--postgres", action="store_true", help="also measure with PostgreSQL")
    parser.add_argument("--accuracy-only", action="store_true",
                        help="skip the overhead measurement")
    parser.add_argument("--server", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.server:
        server_main(json.loads(args.server))
        return 0
    started = time.perf_counter()
    result = asyncio.run(run(args))
    result["elapsed_s"] = time.perf_counter() - started
    print_table(result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
