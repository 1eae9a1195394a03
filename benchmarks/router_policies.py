"""Routing policies on real workers: prefix-cache hit rate, TTFT and load balance.

Two `sluice worker` processes on the default model (SmolLM2-135M GGUF, KV events on) and
one `sluice router` process per policy in front of them. Two seeded workloads:

- shared-prefix: G groups, each a long system prompt, many short questions per group;
- multi-turn: S chat sessions of T turns, each turn resending the growing history.

Requests stream (`max_tokens` small) at a fixed concurrency. Per policy we report the
workers' prefix-cache hit rate (delta of `vllm:prefix_cache_hits/queries` over the run),
client TTFT p50/p99, and the busiest worker's share of requests vs the mean. The
reference hit rate is the same workload sent to one worker alone (no routing can beat
a single shared cache). Each policy gets fresh prompts (its own seed), so earlier runs'
cache contents do not help it.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/router_policies.py

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from router_overhead import wait_http  # benchmarks/ is on sys.path when run as a script

from sluice.control.local import LocalWorkerPool, free_port
from sluice.observe.prometheus import sum_samples
from sluice.router.scrape import parse_load

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
         "zulu river mountain forest ocean desert valley city village bridge tower garden "
         "engine signal copper silver market harbor lantern meadow orchard").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Turn:
    messages: list[dict[str, str]]


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    errors: int = 0


def shared_prefix(seed: int, groups: int, per_group: int, sys_words: int) -> list[list[Turn]]:
    """Each request its own one-turn 'session', groups in a seeded random order (a fixed
    interleaving would let round robin pin each group to one worker by accident)."""
    rng = random.Random(seed)
    systems = [f"You are assistant {seed}-{g}. " + text(rng, sys_words) for g in range(groups)]
    reqs = [[Turn([{"role": "system", "content": systems[g]},
                   {"role": "user", "content": f"Question {i}: {text(rng, 8)}?"}])]
            for i in range(per_group) for g in range(groups)]
    rng.shuffle(reqs)
    return reqs


def multi_turn(seed: int, sessions: int, turns: int, words: int) -> list[list[Turn]]:
    rng = random.Random(seed)
    out = []
    for s in range(sessions):
        history = [{"role": "system", "content": f"Session {seed}-{s}. " + text(rng, words)}]
        session = []
        for t in range(turns):
            history = history + [{"role": "user", "content": f"Turn {t}: {text(rng, words)}"}]
            session.append(Turn(list(history)))
            history = history + [{"role": "assistant", "content": text(rng, 12)}]
        out.append(session)
    return out


async def run_sessions(url: str, model: str, sessions: Sequence[list[Turn]], concurrency: int,
                       max_tokens: int) -> Stats:
    stats = Stats()
    queue: asyncio.Queue[tuple[int, list[Turn]]] = asyncio.Queue()
    for i, s in enumerate(sessions):
        queue.put_nowait((i, s))

    async def client(c: httpx.AsyncClient) -> None:
        while not queue.empty():
            i, session = queue.get_nowait()
            for turn in session:
                body = {"model": model, "messages": turn.messages, "max_tokens": max_tokens,
                        "stream": True, "temperature": 0}
                t0 = time.perf_counter()
                try:
                    async with c.stream("POST", "/v1/chat/completions", json=body,
                                        headers={"x-session-id": f"s{i}"}) as r:
                        if r.status_code != 200:
                            stats.errors += 1
                            await r.aread()
                            continue
                        first = None
                        async for line in r.aiter_lines():
                            if first is None and line.startswith("data:") and '"content"' in line:
                                first = time.perf_counter() - t0
                        stats.ttft.append(first if first is not None else time.perf_counter() - t0)
                except httpx.HTTPError:
                    stats.errors += 1

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        await asyncio.gather(*(client(c) for _ in range(concurrency)))
    return stats


def worker_counters(urls: Sequence[str]) -> dict[str, dict[str, float]]:
    out = {}
    for u in urls:
        text_ = httpx.get(u + "/metrics", timeout=10).text
        load = parse_load(text_)
        samples = sum_samples(text_)
        out[u] = {"hits": load.prefix_hits, "queries": load.prefix_queries,
                  "prompt_tokens": samples.get("vllm:prompt_tokens_total", 0.0),
                  "requests": samples.get("vllm:e2e_request_latency_seconds_count", 0.0)}
    return out


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(target_urls: Sequence[str], url: str, model: str, sessions: list[list[Turn]],
            args: argparse.Namespace) -> dict[str, Any]:
    before = worker_counters(target_urls)
    t0 = time.perf_counter()
    stats = asyncio.run(run_sessions(url, model, sessions, args.concurrency, args.max_tokens))
    elapsed = time.perf_counter() - t0
    after = worker_counters(target_urls)
    delta = {u: {k: after[u][k] - before[u][k] for k in after[u]} for u in target_urls}
    hits = sum(d["hits"] for d in delta.values())
    queries = sum(d["queries"] for d in delta.values())
    reqs = [d["requests"] for d in delta.values()]
    mean = sum(reqs) / len(reqs)
    return {"hit_rate": hits / queries if queries else 0.0, "ttft_p50_s": pct(stats.ttft, 0.5),
            "ttft_mean_s": sum(stats.ttft) / max(1, len(stats.ttft)),
            "ttft_p90_s": pct(stats.ttft, 0.9),
            "ttft_p99_s": pct(stats.ttft, 0.99), "requests": len(stats.ttft),
            "errors": stats.errors, "seconds": elapsed,
            "per_worker_requests": reqs,
            "per_worker_prefill_tokens": [d["queries"] - d["hits"] for d in delta.values()],
            "busiest_over_mean": (max(reqs) / mean) if mean else float("nan")}


def router_learned(url: str) -> dict[str, dict[str, float]]:
    """The router's learned TTFT line per worker (seconds per token, overhead)."""
    out: dict[str, dict[str, float]] = {}
    names = {"sluice_router_worker_seconds_per_token": "seconds_per_token",
             "sluice_router_worker_overhead_seconds": "overhead_s"}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, rest = line.partition("{")
        if name in names and 'worker="' in rest:
            worker = rest.split('worker="', 1)[1].split('"', 1)[0]
            out.setdefault(worker, {})[names[name]] = float(line.rsplit(" ", 1)[1])
    return out


def start_router(workers: LocalWorkerPool, policy: str, tokenizer: str | None,
                 log_path: str | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`log_path`: run it at debug level (one line per routing decision) into that file."""
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "router", "--policy", policy, "--port", str(port),
           "--log-level", "debug" if log_path else "warning", "--seed", "0"]
    for u, kv in zip(workers.urls, workers.kv_endpoints, strict=True):
        cmd += ["--worker", u, "--worker-kv-events", f"{u}={kv}"]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    err = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="worker model (default: SmolLM2-135M GGUF)")
    ap.add_argument("--policies", nargs="+",
                    default=["round_robin", "least_load", "prefix", "kv", "cost"])
    ap.add_argument("--workloads", nargs="+", default=["shared-prefix", "multi-turn"])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=300)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-words", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--router-log-dir", default=None,
                    help="write each router's routing decisions (debug log) to DIR/WORKLOAD-POLICY.log")
    args = ap.parse_args()

    from sluice.engine.tokenizer import resolve_model

    model_path = resolve_model(args.model)
    worker_args = ["--model", model_path, "--max-model-len", "2048"]
    env = {"OMP_NUM_THREADS": str(args.threads_per_worker)}
    results: dict[str, dict[str, Any]] = {}
    with LocalWorkerPool(2, worker_args, kv_events=True, env=env, startup_timeout_s=300) as workers:
        model = httpx.get(workers.urls[0] + "/v1/models").json()["data"][0]["id"]

        def workload(name: str, seed: int) -> list[list[Turn]]:
            if name == "shared-prefix":
                return shared_prefix(seed, args.groups, args.per_group, args.system_words)
            return multi_turn(seed, args.sessions, args.turns, args.turn_words)

        # warm-up: load both engines' code paths
        asyncio.run(run_sessions(workers.urls[0], model, workload("multi-turn", 999)[:1], 1, 2))
        asyncio.run(run_sessions(workers.urls[1], model, workload("multi-turn", 998)[:1], 1, 2))
        for w_i, wname in enumerate(args.workloads):
            res: dict[str, Any] = {}
            res["single_worker"] = measure([workers.urls[0]], workers.urls[0], model,
                                           workload(wname, 100 * w_i), args)
            for p_i, policy in enumerate(args.policies):
                log_path = (os.path.join(args.router_log_dir, f"{wname}-{policy}.log")
                            if args.router_log_dir else None)
                proc, url = start_router(workers, policy, model_path, log_path)
                try:
                    res[policy] = measure(workers.urls, url, model,
                                          workload(wname, 100 * w_i + p_i + 1), args)
                    res[policy]["router_learned"] = router_learned(url)
                finally:
                    proc.terminate()
                    proc.wait(10)
                print(f"  {wname:14} {policy:12} done", file=sys.stderr)
            results[wname] = res

    print(f"{'workload':14} {'policy':14} {'hit rate':>9} {'vs single':>9} {'TTFT p50':>9} "
          f"{'TTFT p90':>9} {'TTFT p99':>9} {'mean':>7} {'busiest/mean':>12} {'requests/worker':>16}")
    for wname, res in results.items():
        single = res["single_worker"]["hit_rate"]
        rr_p50 = res.get("round_robin", {}).get("ttft_p50_s")
        for policy, r in res.items():
            r["hit_rate_vs_single"] = r["hit_rate"] / single if single else float("nan")
            if rr_p50:
                r["ttft_p50_vs_round_robin"] = r["ttft_p50_s"] / rr_p50
            print(f"{wname:14} {policy:14} {r['hit_rate']:9.3f} {r['hit_rate_vs_single']:9.2f} "
                  f"{r['ttft_p50_s']:9.3f} {r['ttft_p90_s']:9.3f} {r['ttft_p99_s']:9.3f} "
                  f"{r['ttft_mean_s']:7.3f} {r['busiest_over_mean']:12.2f} "
                  f"{str([int(x) for x in r['per_worker_requests']]):>16}")
    print(json.dumps({"benchmark": "router_policies", "cores": os.cpu_count(),
                      "args": vars(args), "results": results}))
    return 0


def _exit_on_sigterm() -> None:
    """`timeout` sends SIGTERM: unwind normally so worker processes are stopped."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


if __name__ == "__main__":
    _exit_on_sigterm()
    raise SystemExit(main())
