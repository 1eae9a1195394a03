"""Router overhead: a fast stub worker served directly vs through `sluice router`.

Three processes: the stub worker (raw ASGI, fixed chat completion), the router in front
of it (`sluice router --worker STUB --policy P`), and this client (raw asyncio HTTP/1.1
keep-alive connections, far cheaper than httpx, so the client is not the bottleneck it
would otherwise be). For each target, in the same run:

1. saturation: closed loop at fixed concurrency for a few seconds -> req/s;
2. fixed rate (open loop, default 1,000 req/s): latency measured from each request's
   scheduled send time (no coordinated omission) -> p50 / p99; the router's *added*
   latency is its percentile minus the direct one.

`sluice router` serves on its own HTTP/1.1 server (router/server.py); `--uvicorn POLICY`
adds the router's ASGI app under uvicorn. `--serve sqlite postgres+redis` adds the
`sluice serve --workers N` path: gateway + router in one process on the router's server
(the gateway an ASGI layer of it; real tokenizer, cost policy, a key per run), with
SQLite + in-process limits or PostgreSQL + Redis; `--serve-uvicorn` adds the same app
under uvicorn (how `sluice serve` ran it before) for comparison.
Optionally the same against SGLang's Rust router (`--sglang-router PYTHON`: a python
that has `sglang_router` installed, in its own venv).

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/router_overhead.py

On this machine everything shares 2 CPU cores with other work. Prints a table; the last
stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from sluice.control.local import free_port

BODY = json.dumps({"model": "stub", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "Say hi."}]}).encode()
RESPONSE = json.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}).encode()
EVENT = b'data: {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
# what a sluice worker sends when the router asks for token ids (to migrate the stream)
EVENT_IDS = (b'data: {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "hi"},'
             b' "token_ids": [6022]}]}\n\n')
MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def request_body(stream_events: int) -> bytes:
    """The benchmark's chat request; streamed with `stream_events` SSE events if > 0."""
    if not stream_events:
        return BODY
    return json.dumps({"model": "stub", "max_tokens": stream_events, "stream": True,
                       "messages": [{"role": "user", "content": "Say hi."}]}).encode()


async def stub_app(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
    """The fastest worker there is: fixed answers, no engine. A streamed request gets
    `max_tokens` SSE events, each its own write, then `data: [DONE]`; with
    `return_token_ids` (the router's, to migrate) the events carry them, as a worker's."""
    if scope["type"] != "http":
        return
    parts, more = [], True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    path = scope["path"]
    if b'"stream": true' in parts[0]:
        request = json.loads(b"".join(parts))
        ids = request.get("return_token_ids", False)
        headers = [(b"content-type", b"text/event-stream")]
        headers += [(b"x-sluice-tokenizer", b"stub")] if ids else []
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        event = EVENT_IDS if ids else EVENT
        for _ in range(request["max_tokens"]):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    body = MODELS if path == "/v1/models" else METRICS if path == "/metrics" else (
        b"" if path == "/health" else RESPONSE)
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Conn:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 request: bytes) -> None:
        self.reader, self.writer, self.request = reader, writer, request
        self.extra_head = ""

    @classmethod
    async def open(cls, port: int, body: bytes = BODY, path: str = "/v1/chat/completions",
                   extra: str = "") -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        return cls(reader, writer, head.encode() + body)

    async def call(self) -> int:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        i = lower.find(b"content-length:")
        if i >= 0:
            n = int(lower[i + 15:lower.index(b"\r\n", i)])
            await self.reader.readexactly(n)
        else:  # chunked
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        return status

    def close(self) -> None:
        self.writer.close()


async def saturate(port: int, concurrency: int, seconds: float, body: bytes = BODY,
                   extra: str = "") -> dict[str, float]:
    conns = [await Conn.open(port, body, extra=extra) for _ in range(concurrency)]
    done = 0
    errors = 0
    stop = time.perf_counter() + seconds

    async def loop(c: Conn) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            if await c.call() != 200:
                errors += 1
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in conns))
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    return {"rps": done / elapsed, "errors": errors}


async def fixed_rate(port: int, rate: float, seconds: float, max_conns: int = 256,
                     body: bytes = BODY, extra: str = "") -> dict[str, float]:
    free: asyncio.Queue[Conn] = asyncio.Queue()
    opened = 0
    lat: list[float] = []
    errors = 0

    async def one(scheduled: float) -> None:
        nonlocal opened, errors
        if free.empty() and opened < max_conns:
            opened += 1
            conn = await Conn.open(port, body, extra=extra)
        else:
            conn = await free.get()
        if await conn.call() != 200:
            errors += 1
        lat.append(time.perf_counter() - scheduled)
        free.put_nowait(conn)

    n = int(rate * seconds)
    start = time.perf_counter() + 0.05
    tasks = []
    for i in range(n):
        at = start + i / rate
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(at)))
    await asyncio.gather(*tasks)
    achieved = n / (time.perf_counter() - start)
    while not free.empty():
        free.get_nowait().close()
    lat.sort()
    return {"rate": rate, "achieved_rps": achieved, "errors": errors,
            "p50_ms": 1e3 * lat[len(lat) // 2], "p99_ms": 1e3 * lat[int(len(lat) * 0.99)],
            "mean_ms": 1e3 * statistics.fmean(lat)}


UVICORN_ROUTER = """
import uvicorn
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
pool = PoolConfig(workers=(WorkerSpec("{stub}"),), policy="{policy}")
uvicorn.run(build_app(RouterConfig(pools=(pool,))), host="127.0.0.1", port={port},
            log_level="warning", access_log=False)
"""


SERVE = """
import json, sys
from sluice.engine.tokenizer import resolve_model
from sluice.gateway.config import GatewayConfig, LimiterConfig
from sluice.gateway.middleware import GatewayMiddleware
from sluice.gateway.state import GatewayState
from sluice.gateway.tokens import PromptTokenCounter
from sluice.protocol.prompt import TokenCache
from sluice.router.app import build_app, routed_first
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
spec = json.loads(sys.argv[1])
cache, source = TokenCache(), resolve_model(None)  # as `sluice serve` composes them
pool = PoolConfig(workers=(WorkerSpec(spec["stub"]),), policy=spec["policy"], tokenizer=source)
app = build_app(RouterConfig(pools=(pool,), admin_key="bench"), token_cache=cache)
config = GatewayConfig(database_url=spec["db"], table_prefix=spec["prefix"], admin_key="bench",
                       await_ledger=spec["await_ledger"],
                       limiter=LimiterConfig(redis_url=spec["redis"], key_prefix=spec["rl"]))
gw = GatewayMiddleware(routed_first(app), GatewayState.from_config(
    config, count_prompt_tokens=PromptTokenCounter(default_source=source, cache=cache)))
if spec["front"] == "server":
    from sluice.router.server import run
    run(gw, "127.0.0.1", spec["port"], state=lambda: app.state.router, direct=False)
else:
    import uvicorn
    uvicorn.run(gw, host="127.0.0.1", port=spec["port"], log_level="warning", access_log=False,
                lifespan="on")
"""
SERVE_CONFIGS = {
    "sqlite": (None, False), "postgres+redis": ("postgresql+psycopg://postgres@127.0.0.1:5432/test",
                                                True)}
BENCH_REDIS = "redis://127.0.0.1:6379/7"  # benchmarks keep to db 7; tests use db 0


def serve_target(stub: str, policy: str, config: str, front: str, tmp: str,
                 await_ledger: bool = False) -> tuple[dict[str, Any], str, Callable[[], None]]:
    """A gateway + router process as `sluice serve --workers N` runs it (`front`:
    "server", the router's own; "uvicorn", how it ran before) with one bench key."""
    import uuid

    from sluice.gateway.store import KeySettings, SQLStore, TenantSettings

    pg, redis = SERVE_CONFIGS[config]
    db = pg or f"sqlite:///{os.path.join(tmp, uuid.uuid4().hex + '.db')}"
    prefix, rl = f"b{uuid.uuid4().hex[:8]}_", f"sluice-bench:{uuid.uuid4().hex}:"
    store = SQLStore(db, table_prefix=prefix)
    store.create_tenant("bench", TenantSettings(rpm=10**8, tpm=10**10))
    _, key = store.create_key("bench", KeySettings())
    spec = {"stub": stub, "policy": policy, "db": db, "prefix": prefix, "front": front,
            "redis": BENCH_REDIS if redis else None, "rl": rl,
            "port": free_port(), "await_ledger": await_ledger}

    def cleanup() -> None:
        store.drop_all()  # with its auth version's Redis mirror key
        store.close()
        if redis:  # this run's limiter keys (they would expire, the slots after 1 h)
            import redis as sync_redis

            client = sync_redis.Redis.from_url(BENCH_REDIS)
            for key in client.scan_iter(match=f"{rl}*"):
                client.delete(key)
            client.close()

    return spec, f"Authorization: Bearer {key}\r\n", cleanup


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def start(cmd: list[str]) -> subprocess.Popen[bytes]:
    """A child process; it can import this file as `router_overhead` from any cwd."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path})


def measure(name: str, port: int, args: argparse.Namespace, extra: str = "") -> dict[str, Any]:
    body = request_body(args.stream_events)

    async def run() -> dict[str, Any]:
        await saturate(port, 8, 0.5, body, extra)  # warm-up
        sat = await saturate(port, args.concurrency, args.seconds, body, extra)
        rates = {}
        for rate in args.rates:
            rates[str(int(rate))] = await fixed_rate(port, rate, args.seconds, body=body,
                                                     extra=extra)
        return {"target": name, "saturation_rps": sat["rps"], "saturation_errors": sat["errors"],
                "fixed_rate": rates}

    # This client's own collector, not the target's, paused whole runs: a full collection
    # over what earlier targets' runs left alive took 10-90 ms on a 2-core AVX2 EPYC,
    # read as that target's p99 (+20-60 ms through the gateway, +2-3 ms with the client's
    # collector off). Collected before, off while measuring.
    gc.collect()
    gc.disable()
    try:
        return asyncio.run(run())
    finally:
        gc.enable()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rates", type=float, nargs="+", default=[500.0, 1000.0])
    ap.add_argument("--policy", nargs="+", default=["round_robin", "cost"])
    ap.add_argument("--migration-limit", type=int, nargs="+", default=[3], metavar="N",
                    help="`sluice router --migration-limit` values to measure (0: off; a "
                    "streamed request is then relayed as it is, not event by event)")
    ap.add_argument("--stream-events", type=int, default=0, metavar="N",
                    help="streamed requests: the stub answers N SSE events (0: one JSON body)")
    ap.add_argument("--uvicorn", nargs="*", default=[], metavar="POLICY",
                    help="also the router's ASGI app under uvicorn (as `sluice serve` and "
                         "the gateway run it) with these policies")
    ap.add_argument("--sglang-router", default=None,
                    help="python of a venv with sglang_router installed")
    ap.add_argument("--serve", nargs="*", default=[], metavar="CONFIG",
                    choices=sorted(SERVE_CONFIGS),
                    help="also gateway + router in one process, as `sluice serve --workers N` "
                         "runs them (the router's server, the gateway a layer of it), with "
                         "these stores: sqlite (+ in-process limits), postgres+redis")
    ap.add_argument("--serve-uvicorn", action="store_true",
                    help="with --serve: also the same app under uvicorn (the old composition)")
    ap.add_argument("--serve-policy", default="cost")
    ap.add_argument("--serve-await-ledger", action="store_true",
                    help="with --serve: also each server target with GatewayConfig.await_ledger "
                         "(every ledger commit before the response, as before)")
    args = ap.parse_args()

    procs: list[subprocess.Popen[bytes]] = []
    results: list[dict[str, Any]] = []
    try:
        stub_port = free_port()
        procs.append(start([sys.executable, "-c",
                            "import uvicorn, router_overhead as b; uvicorn.run(b.stub_app, "
                            f"host='127.0.0.1', port={stub_port}, log_level='warning', "
                            "access_log=False)"]))
        stub = f"http://127.0.0.1:{stub_port}"
        wait_http(stub + "/health")
        results.append(measure("direct", stub_port, args))
        for policy in args.policy:
            for limit in args.migration_limit:
                port = free_port()
                p = start([sys.executable, "-m", "sluice.cli", "router", "--worker", stub,
                           "--policy", policy, "--port", str(port), "--log-level", "warning",
                           "--migration-limit", str(limit)])
                procs.append(p)
                wait_http(f"http://127.0.0.1:{port}/health")
                label = "" if args.migration_limit == [3] else f", migration {limit}"
                results.append(measure(f"sluice router ({policy}{label})", port, args))
                p.terminate()
                p.wait(10)
        for policy in args.uvicorn:
            port = free_port()
            p = start([sys.executable, "-c", UVICORN_ROUTER.format(stub=stub, policy=policy,
                                                                   port=port)])
            procs.append(p)
            wait_http(f"http://127.0.0.1:{port}/health")
            results.append(measure(f"router app on uvicorn ({policy})", port, args))
            p.terminate()
            p.wait(10)
        import tempfile

        tmp = tempfile.mkdtemp(prefix="sluice-serve-bench-")
        fronts = [("server", False)] + ([("server", True)] if args.serve_await_ledger else []) \
            + ([("uvicorn", False)] if args.serve_uvicorn else [])
        for config in args.serve:
            for front, await_ledger in fronts:
                spec, extra, cleanup = serve_target(stub, args.serve_policy, config, front, tmp,
                                                    await_ledger)
                label = front + (", await_ledger" if await_ledger else "")
                p = start([sys.executable, "-c", SERVE, json.dumps(spec)])
                procs.append(p)
                try:
                    wait_http(f"http://127.0.0.1:{spec['port']}/health")
                    results.append(measure(f"gateway+router {label} ({config})", spec["port"],
                                           args, extra))
                finally:
                    p.terminate()
                    p.wait(10)
                    cleanup()
        if args.sglang_router:
            port = free_port()
            p = start([args.sglang_router, "-m", "sglang_router.launch_router",
                       "--worker-urls", stub, "--port", str(port), "--host", "127.0.0.1",
                       "--policy", "round_robin", "--prometheus-port", str(free_port()),
                       "--log-level", "error"])
            procs.append(p)
            wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
            results.append(measure("sglang-router (round_robin)", port, args))
            p.terminate()
            p.wait(10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)

    direct = results[0]
    print(f"{'target':34} {'sat req/s':>10} " + " ".join(
        f"{'@' + r + ' p50/p99 ms (added)':>34}" for r in direct["fixed_rate"]))
    for r in results:
        cells = []
        for rate, fr in r["fixed_rate"].items():
            d = direct["fixed_rate"][rate]
            cells.append(f"{fr['p50_ms']:6.2f}/{fr['p99_ms']:6.2f} "
                         f"(+{fr['p50_ms'] - d['p50_ms']:5.2f}/+{fr['p99_ms'] - d['p99_ms']:5.2f})"
                         f" {fr['achieved_rps']:5.0f}/s")
        print(f"{r['target']:34} {r['saturation_rps']:10.0f} " + " ".join(f"{c:>34}" for c in cells))
    for r in results:
        for rate, fr in r["fixed_rate"].items():
            d = direct["fixed_rate"][rate]
            fr["added_p50_ms"] = fr["p50_ms"] - d["p50_ms"]
            fr["added_p99_ms"] = fr["p99_ms"] - d["p99_ms"]
    print(json.dumps({"benchmark": "router_overhead", "cores": os.cpu_count(),
                      "stream_events": args.stream_events, "results": results}))
    return 0


def _exit_on_sigterm() -> None:
    """`timeout` sends SIGTERM: unwind normally so worker processes are stopped."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


if __name__ == "__main__":
    _exit_on_sigterm()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    raise SystemExit(main())
