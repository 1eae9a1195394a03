"""Routing policies against simulated workers: deterministic cache and queue behaviour.

Real workers on 2 shared CPU cores make noisy timings, so this companion to
`router_policies.py` runs the real router (in process, real HTTP, real ZMQ KV events)
in front of N *simulated* workers whose cost model is explicit:

- a prefix cache of `--cache-blocks` 16-token blocks (LRU), keyed by the same chained
  block hashes the engine uses, publishing `BlockStored` / `BlockRemoved` events;
- one prefill at a time, FIFO: prefill takes `uncached tokens × --prefill-ms-per-token`;
- decoding overlaps (batched): `--decode-ms` per output token, not blocking prefills;
- /metrics with vLLM's gauge and prefix-cache counter names, /tokenize; prompts are
  templated and tokenized with the default model's real tokenizer, which the router
  also loads (`--tokenizer`), as in a real deployment.

The router runs as its own `sluice router` process; the simulated workers and the
client share this one. Workloads as in `router_policies.py` (shared-prefix, multi-turn), sent at a fixed
concurrency. Reported per policy: prefix-cache hit rate (vs one worker serving all of
it), TTFT p50/p99 (vs round robin), busiest worker's requests over the mean.

    .venv/bin/python benchmarks/router_policies_sim.py
    .venv/bin/python benchmarks/router_policies_sim.py --virtual

`--virtual` replays the same workers and clients in virtual time around the router's
real `Pool` and policy objects (no HTTP, no processes; a fixed per-request overhead, the
KV-event lag and the scrape interval stand in for them): deterministic and about a second
per run, for judging a policy change without CPU noise. `prefill` in the table is the
prompt tokens the workers computed, over what one worker serving everything computes
(1.00: no prefix computed twice).

`sluice sim` (docs/sim.md) supersedes `--virtual`: it runs the same real `Pool` in front
of the engine's real `Scheduler` and `BlockManager` (this replay's workers are a toy FIFO
cost model), at thousands of workers, with the bench's report.

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import heapq
import itertools
import json
import os
import random
import sys
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from sluice.engine.kv_events import KVEventPublisher
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.kv_events import BlockRemoved, BlockStored, KVEvent
from sluice.router.config import PoolConfig, WorkerSpec
from sluice.router.endpoints import Ticket
from sluice.router.policies import RequestMeta
from sluice.router.pool import Pool
from sluice.router.scrape import WorkerLoad

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_policies import multi_turn, pct, shared_prefix  # noqa: E402

from sluice.control.local import free_port

BLOCK = 16
SCRAPE_S = 0.2  # the router's --scrape-interval in both modes


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The default model's real tokenizer and chat template (torch-free), as a worker uses."""
    from sluice.engine.tokenizer import load_tokenizer

    return load_tokenizer(None)


def prompt_ids(body: dict[str, Any]) -> list[int]:
    tok = tokenizer()
    if "messages" in body:
        text = tok.apply_chat_template(body["messages"], add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))
    return list(tok.encode(str(body.get("prompt", ""))))


@dataclass
class SimWorker:
    name: str
    cache_blocks: int
    prefill_s_per_token: float
    decode_s: float
    publisher: KVEventPublisher | None = None
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: int = 0
    running: int = 0
    queries: int = 0
    hits: int = 0
    requests: int = 0

    def lookup_and_insert(self, ids: list[int]) -> tuple[int, list[KVEvent]]:
        """Cached prefix tokens; then the prompt's blocks are stored (LRU evicts). Counts the
        query and returns the KV events it caused."""
        hashes = hash_blocks(ids, BLOCK)
        hit = 0
        for h in hashes:
            if h not in self.cache:
                break
            hit += 1
        events: list[KVEvent] = []
        stored = [h for h in hashes if h not in self.cache]
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        evicted = []
        while len(self.cache) > self.cache_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        if stored:
            events.append(BlockStored(stored, None, [], BLOCK))
        if evicted:
            events.append(BlockRemoved(evicted))
        self.queries += len(ids)
        self.hits += hit * BLOCK
        return hit * BLOCK, events

    async def generate(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        ids = prompt_ids(body)
        self.requests += 1
        self.waiting += 1
        try:
            async with self.lock:  # one prefill at a time
                self.waiting -= 1
                cached, events = self.lookup_and_insert(ids)
                if self.publisher is not None and events:
                    self.publisher.publish(events)
                await asyncio.sleep((len(ids) - cached) * self.prefill_s_per_token)
            self.running += 1
            for i in range(int(body.get("max_tokens") or 4)):
                if i:
                    await asyncio.sleep(self.decode_s)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            if self.running:
                self.running -= 1

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.json()
            return StreamingResponse(self.generate(body), media_type="text/event-stream")

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(
                f"vllm:num_requests_running {self.running}\n"
                f"vllm:num_requests_waiting {self.waiting}\n"
                f"vllm:kv_cache_usage_perc {len(self.cache) / self.cache_blocks}\n"
                f"vllm:prefix_cache_queries_total {self.queries}\n"
                f"vllm:prefix_cache_hits_total {self.hits}\n")

        async def tokenize(request: Request) -> Response:
            ids = prompt_ids(await request.json())
            return JSONResponse({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids})

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "sim", "object": "model"}]})

        async def health(_: Request) -> Response:
            return PlainTextResponse("ok")

        return Starlette(routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/metrics", metrics), Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models), Route("/health", health)])


@asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def router_process(policy: str, specs: list[WorkerSpec]) -> AsyncIterator[str]:
    """`sluice router` in its own process, as deployed (its CPU is not this loop's)."""
    port = free_port()
    from sluice.engine.tokenizer import resolve_model

    cmd = [sys.executable, "-m", "sluice.cli", "router", "--policy", policy, "--port", str(port),
           "--seed", "0", "--scrape-interval", str(SCRAPE_S), "--log-level", "warning",
           "--tokenizer", resolve_model(None)]
    for spec in specs:
        cmd += ["--worker", spec.url, "--worker-kv-events", f"{spec.url}={spec.kv_events}"]
    proc = await asyncio.create_subprocess_exec(*cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as c:
            for _ in range(300):
                try:
                    if (await c.get(url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)  # KV subscribers connect
        yield url
    finally:
        proc.terminate()
        await proc.wait()


async def drive(url: str, sessions: list[list[Any]], concurrency: int, max_tokens: int
                ) -> list[float]:
    ttfts: list[float] = []
    queue = list(enumerate(sessions))[::-1]
    loop = asyncio.get_running_loop()

    async def client(c: httpx.AsyncClient) -> None:
        while queue:
            i, session = queue.pop()
            for turn in session:
                body = {"model": "sim", "messages": turn.messages, "max_tokens": max_tokens,
                        "stream": True}
                t0 = loop.time()
                async with c.stream("POST", "/v1/chat/completions", json=body,
                                    headers={"x-session-id": f"s{i}"}) as r:
                    first = None
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data:"):
                            first = loop.time() - t0
                    ttfts.append(first if first is not None else loop.time() - t0)

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
    return ttfts


async def run_one(policy: str | None, sessions: list[list[Any]], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """`policy=None`: one worker alone (the hit-rate reference)."""
    n = 1 if policy is None else args.workers
    async with AsyncExitStack() as stack:
        workers, specs = [], []
        for i in range(n):
            kv = f"tcp://127.0.0.1:{free_port()}"
            w = SimWorker(f"w{i}", args.cache_blocks, args.prefill_ms_per_token / 1e3,
                          args.decode_ms / 1e3, KVEventPublisher(kv))
            stack.callback(w.publisher.close)  # type: ignore[union-attr]
            url = await stack.enter_async_context(serve(w.app()))
            workers.append(w)
            specs.append(WorkerSpec(url, kv_events=kv))
        target = specs[0].url if policy is None else await stack.enter_async_context(
            router_process(policy, specs))
        ttfts = await drive(target, sessions, args.concurrency, args.max_tokens)
    return summary(workers, ttfts)


def summary(workers: list[SimWorker], ttfts: list[float]) -> dict[str, Any]:
    reqs = [w.requests for w in workers]
    queries = sum(w.queries for w in workers)
    return {"hit_rate": sum(w.hits for w in workers) / queries, "ttft_p50_s": pct(ttfts, 0.5),
            "ttft_mean_s": sum(ttfts) / len(ttfts), "ttft_p90_s": pct(ttfts, 0.9),
            "ttft_p99_s": pct(ttfts, 0.99), "per_worker_requests": reqs,
            "busiest_over_mean": max(reqs) / (sum(reqs) / len(reqs)),
            "prefill_tokens": queries - sum(w.hits for w in workers)}


@dataclass
class Pending:
    """A request in a replayed worker's queue."""

    ids: list[int]
    ticket: Ticket
    sent_at: float
    then: Callable[[], None]  # the client's next turn, once the stream has ended


class Replay:
    """The same workers and clients in virtual time around the router's real `Pool` and
    policy, with no HTTP and no processes: deterministic, about a second per run, so a
    policy change can be judged without CPU noise. What the HTTP run adds is modelled by a
    fixed per-request overhead (half before routing, half after the first token), the
    KV-event lag and the scrape interval."""

    def __init__(self, policy: str, n_workers: int, args: argparse.Namespace) -> None:
        self.args, self.now = args, 0.0
        self.ttfts: list[float] = []
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.workers = {f"http://w{i}": SimWorker(f"w{i}", args.cache_blocks,
                                                  args.prefill_ms_per_token / 1e3,
                                                  args.decode_ms / 1e3)
                        for i in range(n_workers)}
        self.queues: dict[str, deque[Pending]] = {u: deque() for u in self.workers}
        self.busy = dict.fromkeys(self.workers, False)
        specs = tuple(WorkerSpec(u, kv_events="tcp://127.0.0.1:1") for u in self.workers)
        self.pool = Pool(PoolConfig(model="sim", policy=policy, workers=specs),
                         random.Random(0), clock=lambda: self.now)
        self.noise = random.Random(args.noise_seed)

    def at(self, delay_s: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (self.now + delay_s, next(self._seq), fn))

    def run(self, sessions: list[list[Any]], concurrency: int) -> list[float]:
        todo = deque(sessions)
        for _ in range(concurrency):
            self.client(todo, deque())
        self.at(SCRAPE_S, self.scrape)
        while self._events:
            self.now, _, fn = heapq.heappop(self._events)
            fn()
        return self.ttfts

    def client(self, todo: deque[list[Any]], turns: deque[Any]) -> None:
        """Send the session's next turn, or start the next session."""
        if not turns and todo:
            turns = deque(todo.popleft())
        if turns:
            ids, sent = prompt_ids({"messages": turns.popleft().messages}), self.now
            self.at(self.args.overhead_ms / 2e3,
                    lambda: self.route(ids, sent, lambda: self.client(todo, turns)))

    def route(self, ids: list[int], sent: float, then: Callable[[], None]) -> None:
        meta = RequestMeta(model="sim", num_prompt_tokens=len(ids),
                           block_hashes=tuple(hash_blocks(ids, BLOCK)), block_size=BLOCK)
        decision = self.pool.decide(meta)
        assert decision is not None
        url = decision.endpoint.url
        self.workers[url].requests += 1
        self.queues[url].append(Pending(ids, self.pool.dispatch(meta, decision), sent, then))
        if not self.busy[url]:
            self.prefill(url)

    def prefill(self, url: str) -> None:
        """One prefill at a time per worker, FIFO; the cache is looked up when it starts."""
        w, req = self.workers[url], self.queues[url].popleft()
        self.busy[url] = True
        cached, events = w.lookup_and_insert(req.ids)
        self.at(self.args.event_lag_ms / 1e3, lambda: self.apply(url, events))
        seconds = (len(req.ids) - cached) * w.prefill_s_per_token
        if self.args.prefill_noise:
            seconds *= self.noise.lognormvariate(0.0, self.args.prefill_noise)
        self.at(seconds, lambda: self.decode(url, req))

    def decode(self, url: str, req: Pending) -> None:
        w, half = self.workers[url], self.args.overhead_ms / 2e3
        w.running += 1
        self.busy[url] = False
        self.at(half, lambda: self.first_token(req))
        self.at((self.args.max_tokens - 1) * w.decode_s, lambda: self.finished(w, req))
        if self.queues[url]:
            self.prefill(url)

    def first_token(self, req: Pending) -> None:
        self.ttfts.append(self.now - req.sent_at)
        req.ticket.endpoint.on_first_byte(req.ticket, learn=True)

    def finished(self, w: SimWorker, req: Pending) -> None:
        w.running -= 1
        self.at(self.args.overhead_ms / 2e3, lambda: self.stream_ended(req))

    def stream_ended(self, req: Pending) -> None:
        req.ticket.endpoint.finish(req.ticket)
        req.then()

    def apply(self, url: str, events: list[KVEvent]) -> None:
        """What the router's KV-event subscriber does with a batch."""
        for ev in events:
            if isinstance(ev, BlockStored):
                self.pool.precise.store(url, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.pool.precise.remove(url, ev.block_hashes)

    def scrape(self) -> None:
        for url, w in self.workers.items():
            self.pool.endpoints[url].load = WorkerLoad(
                running=w.running, waiting=len(self.queues[url]),
                kv_usage=len(w.cache) / w.cache_blocks)
        if self._events:
            self.at(SCRAPE_S, self.scrape)


def replay_one(policy: str | None, sessions: list[list[Any]], args: argparse.Namespace
               ) -> dict[str, Any]:
    """`run_one` in virtual time."""
    sim = Replay(policy or "round_robin", 1 if policy is None else args.workers, args)
    ttfts = sim.run(sessions, args.concurrency)
    return summary(list(sim.workers.values()), ttfts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", nargs="+",
                    default=["round_robin", "least_load", "session", "prefix", "kv", "cost"])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--turn-words", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--cache-blocks", type=int, default=2000)
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.5)
    ap.add_argument("--decode-ms", type=float, default=5.0)
    ap.add_argument("--virtual", action="store_true",
                    help="replay in virtual time around the real Pool and policy (no HTTP)")
    ap.add_argument("--overhead-ms", type=float, default=4.0,
                    help="--virtual: fixed per-request HTTP and router time")
    ap.add_argument("--event-lag-ms", type=float, default=2.0,
                    help="--virtual: KV-event delay from prefill start to the router's index")
    ap.add_argument("--prefill-noise", type=float, default=0.0,
                    help="--virtual: each prefill takes its time × lognormal(0, this)")
    ap.add_argument("--noise-seed", type=int, default=0)
    args = ap.parse_args()

    def one(policy: str | None, sessions: list[list[Any]]) -> dict[str, Any]:
        if args.virtual:
            return replay_one(policy, sessions, args)
        return asyncio.run(run_one(policy, sessions, args))

    results: dict[str, dict[str, Any]] = {}
    for w_i, wname in enumerate(["shared-prefix", "multi-turn"]):
        seed = 1000 + w_i
        sessions = (shared_prefix(seed, args.groups, args.per_group, args.system_words)
                    if wname == "shared-prefix"
                    else multi_turn(seed, args.sessions, args.turns, args.turn_words))
        res = {"single_worker": one(None, sessions)}
        for policy in args.policies:
            res[policy] = one(policy, sessions)
            print(f"  {wname} {policy} done", file=sys.stderr)
        results[wname] = res

    print(f"{'workload':14} {'policy':14} {'hit rate':>9} {'vs single':>9} {'TTFT p50':>9} "
          f"{'vs RR':>6} {'p90':>7} {'p99':>7} {'mean':>7} {'busiest/mean':>12} {'prefill':>8}"
          "  requests/worker")
    for wname, res in results.items():
        single, rr = res["single_worker"]["hit_rate"], res["round_robin"]["ttft_p50_s"]
        single_prefill = res["single_worker"]["prefill_tokens"]
        for policy, r in res.items():
            r["hit_rate_vs_single"] = r["hit_rate"] / single
            r["prefill_vs_single"] = r["prefill_tokens"] / single_prefill
            r["ttft_p50_vs_round_robin"] = r["ttft_p50_s"] / rr
            print(f"{wname:14} {policy:14} {r['hit_rate']:9.3f} {r['hit_rate_vs_single']:9.2f} "
                  f"{r['ttft_p50_s']:9.3f} {r['ttft_p50_vs_round_robin']:6.2f} "
                  f"{r['ttft_p90_s']:7.3f} {r['ttft_p99_s']:7.3f} {r['ttft_mean_s']:7.3f} "
                  f"{r['busiest_over_mean']:12.2f} {r['prefill_vs_single']:8.2f}"
                  f"  {r['per_worker_requests']}")
    print(json.dumps({"benchmark": "router_policies_sim", "args": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
