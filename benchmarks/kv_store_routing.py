"""Two workers behind the router, with and without the shared KV store, on the Mooncake trace.

Every `--every`-th row of the shared Mooncake-format trace (its reuse is long-range: the
first 300 rows alone hold 5% repeated blocks, the whole trace 64%, so the sample spans
the trace), time-scaled, replayed as `/v1/completions` with token-id prompts: a row's
first `--max-blocks` hash ids, id `h` as 16 token ids drawn from a generator seeded by
`h` (one engine block per trace block: equal hash-id prefixes are equal token
prefixes), then one token of the row's own.
Each configuration gets fresh workers (`sluice worker`, KV events on) and a `cost`
router; with the store, both workers run `--kv-store redis://127.0.0.1:6379/DB` on a
database emptied of sluice keys first.

Reports the workers' prefix-cache hit rate (delta of `vllm:prefix_cache_hits/queries`,
store loads included: loaded blocks count as pool hits) against the oracle (one infinite
cache over the same prompts, full blocks), and client TTFT p50/p90.

    flock /tmp/sluice-heavy.lock timeout 600 .venv/bin/python benchmarks/kv_store_routing.py \\
        --trace /work/shared/traces/mooncake_synthetic_trace.jsonl

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any

import httpx
from router_overhead import wait_http  # noqa: F401  (benchmarks/ on sys.path)
from router_policies import pct, start_router, worker_counters

from sluice.control.local import LocalWorkerPool
from sluice.observe.prometheus import sum_samples

BLOCK = 16


def prompts(path: str, rows: int, every: int, max_blocks: int, time_scale: float,
            output_scale: float) -> list[tuple[float, list[int], int]]:
    """Every `every`-th row of the first `rows`: its first `max_blocks` hash ids as
    blocks of 16 token ids, then one token of its own (a full cached prefix can hit)."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= rows:
                break
            if i % every:
                continue
            r = json.loads(line)
            toks: list[int] = []
            for h in r["hash_ids"][:max_blocks]:
                rng = random.Random(h)
                toks += [rng.randrange(1000, 40000) for _ in range(BLOCK)]
            toks.append(40000 + i % 9000)
            out.append((r["timestamp"] / 1000.0 * time_scale, toks,
                        max(1, round(r["output_length"] * output_scale))))
    return out


def oracle_hit_rate(reqs: list[tuple[float, list[int], int]]) -> float:
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for _, toks, _ in reqs:
        for b in range(len(toks) // BLOCK):
            key = tuple(toks[:(b + 1) * BLOCK])
            total += BLOCK
            if key in seen:
                hits += BLOCK
            seen.add(key)
    return hits / total if total else 0.0


async def replay(url: str, model: str, reqs: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    ttft: list[float] = []
    errors = 0
    t0 = time.perf_counter()

    async def one(c: httpx.AsyncClient, at: float, toks: list[int], n_out: int) -> None:
        nonlocal errors
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        body = {"model": model, "prompt": toks, "max_tokens": n_out, "stream": True,
                "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    errors += 1
                    print(await r.aread(), file=sys.stderr)
                    return
                first = None
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter() - start
                ttft.append(first if first is not None else time.perf_counter() - start)
        except httpx.HTTPError:
            errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await asyncio.gather(*(one(c, at, toks, n) for at, toks, n in reqs))
    return {"ttft_p50_s": pct(ttft, 0.5), "ttft_p90_s": pct(ttft, 0.9), "requests": len(ttft),
            "errors": errors, "seconds": time.perf_counter() - t0}


# the workers' offload counters (summed over media), whose deltas explain the store's hits
STORE_COUNTERS = {
    "hit_tokens": "vllm:external_prefix_cache_hits_total",
    "query_tokens": "vllm:external_prefix_cache_queries_total",
    "bytes_stored": "sluice:kv_offload_bytes_stored_total",
    "errors": "sluice:kv_offload_errors_total",
    "skipped": "sluice:kv_offload_skipped_blocks_total",
    "write_drops": "sluice:kv_offload_write_drops_total",
    "prefetch_absent": "sluice:kv_offload_prefetch_absent_total",
    "prefetch_waits": "sluice:kv_offload_prefetch_waits_total",
    "fetch_misses": "sluice:kv_offload_fetch_misses_total",
}


STORE_GAUGES = {  # the engines' measured costs at the end (one medium: the store)
    "load_s_per_block": "sluice:kv_offload_load_seconds_per_block",
    "prefill_s_per_block": "sluice:kv_offload_prefill_seconds_per_block",
}


def store_counters(urls: list[str]) -> dict[str, dict[str, float]]:
    out = {}
    for u in urls:
        samples = sum_samples(httpx.get(u + "/metrics", timeout=10).text)
        out[u] = {k: samples.get(name, 0.0) for k, name in (STORE_COUNTERS | STORE_GAUGES).items()}
    return out


def clear_store(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter("sluice:kv:*", count=1000))
    if keys:
        client.delete(*keys)


def run(config: str, args: argparse.Namespace, model_path: str,
        reqs: list[tuple[float, list[int], int]]) -> dict[str, Any]:
    worker_args = ["--model", model_path, "--max-model-len", "4096"]
    if args.pool_blocks:  # blocks, whatever the dtype (was bytes: 2x the blocks in bf16)
        worker_args += ["--num-kv-blocks", str(args.pool_blocks)]
    if config == "store":
        clear_store(args.store)
        worker_args += ["--kv-store", args.store]
    env = {"OMP_NUM_THREADS": "1"}
    with LocalWorkerPool(2, worker_args, kv_events=True, env=env, startup_timeout_s=300) as workers:
        model = httpx.get(workers.urls[0] + "/v1/models").json()["data"][0]["id"]
        saved = os.environ.get("PYTHONPATH")
        if args.router_pythonpath:  # A/B: another checkout's router, these workers
            os.environ["PYTHONPATH"] = args.router_pythonpath
        try:
            proc, url = start_router(workers, "cost", model_path)
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
        try:
            before = worker_counters(workers.urls)
            store_before = store_counters(workers.urls)
            res = asyncio.run(replay(url, model, reqs))
            time.sleep(1.0)
            after = worker_counters(workers.urls)
            store_after = store_counters(workers.urls)
        finally:
            proc.terminate()
            proc.wait(10)
    d = {k: sum(after[u][k] - before[u][k] for u in workers.urls) for k in ("hits", "queries")}
    res["hit_rate"] = d["hits"] / d["queries"] if d["queries"] else 0.0
    res["per_worker_requests"] = [after[u]["requests"] - before[u]["requests"] for u in workers.urls]
    res["store"] = {k: sum(store_after[u][k] - store_before[u][k] for u in workers.urls)
                    for k in STORE_COUNTERS}
    res["store_costs_ms"] = {k: [round(store_after[u][k] * 1e3, 2) for u in workers.urls]
                             for k in STORE_GAUGES}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--max-blocks", type=int, default=8)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--output-token-scale", type=float, default=0.02)
    ap.add_argument("--store", default="redis://127.0.0.1:6379/7")
    ap.add_argument("--configs", nargs="+", default=["none", "store"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--router-pythonpath", default=None,
                    help="PYTHONPATH for the router process only (A/B of router versions)")
    ap.add_argument("--pool-blocks", type=int, default=0,
                    help="each worker's KV pool in blocks (default: the engine's)")
    args = ap.parse_args()

    from sluice.engine.tokenizer import resolve_model

    model_path = resolve_model(args.model)
    reqs = prompts(args.trace, args.rows, args.every, args.max_blocks, args.time_scale,
                   args.output_token_scale)
    oracle = oracle_hit_rate(reqs)
    results = {}
    for config in args.configs:
        results[config] = r = run(config, args, model_path, reqs)
        r["hit_rate_vs_oracle"] = r["hit_rate"] / oracle if oracle else float("nan")
        print(f"  {config} done", file=sys.stderr)
    print(f"{'config':8} {'hit rate':>9} {'oracle':>7} {'vs oracle':>9} {'TTFT p50':>9} "
          f"{'TTFT p90':>9} {'errors':>6} {'requests/worker':>16}")
    for config, r in results.items():
        print(f"{config:8} {r['hit_rate']:9.3f} {oracle:7.3f} {r['hit_rate_vs_oracle']:9.2f} "
              f"{r['ttft_p50_s']:9.3f} {r['ttft_p90_s']:9.3f} {r['errors']:6d} "
              f"{str([int(x) for x in r['per_worker_requests']]):>16}")
    for config, r in results.items():
        print(f"{config:8} offload: " + ", ".join(f"{k} {v:.0f}" for k, v in r["store"].items())
              + "; ms per block per worker: " + str(r["store_costs_ms"]))
    print(json.dumps({"benchmark": "kv_store_routing", "cores": os.cpu_count(), "oracle": oracle,
                      "args": vars(args), "results": results}))
    return 0


if __name__ == "__main__":
    from router_policies import _exit_on_sigterm

    _exit_on_sigterm()
    raise SystemExit(main())
