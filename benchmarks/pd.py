"""Prefill/decode disaggregation against a colocated pool, and conditional vs always vs never.

(a) `mixed`: short streams decode without pause (`--decoders` clients in a loop, short
    token-id prompts, `--short-tokens` each) while long prompts (`--long-tokens` token
    ids, `--long-out` tokens) arrive every `--long-every` seconds (seeded jitter), for
    `--seconds`. The same workload against, in one run:
      colocated   2 workers (`--role both`) behind a `cost` router
      pd          1 prefill + 1 decode worker behind a disaggregated router
                  (`--pd-mode conditional --pd-min-uncached-tokens --pd-threshold`)
    Reports the short streams' TPOT p50/p99 and ITL p99, the long prompts' TTFT,
    goodput (requests per second finished with TPOT <= `--tpot-slo`) and throughput
    (output tokens per second, requests per second).
(b) `trace`: the shared Mooncake-format trace (every `--every`-th row, each hash id a
    16-token block as in kv_store_routing.py, up to `--trace-blocks` blocks, outputs
    x `--output-token-scale`, timestamps x `--time-scale`) on 1 prefill + 1 decode
    worker, fresh workers per mode: conditional, always, never. Goodput: requests per
    second with TTFT <= `--ttft-slo` and TPOT <= `--tpot-slo`.

Workers: `sluice worker` on the default model, `OMP_NUM_THREADS=1` each, KV events on.

    flock /tmp/sluice-heavy.lock timeout 1500 .venv/bin/python benchmarks/pd.py \\
        --parts mixed trace --trace /work/shared/traces/mooncake_synthetic_trace.jsonl

Prints a table per part; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import httpx
from kv_store_routing import prompts as trace_prompts
from router_overhead import wait_http
from router_policies import pct

from sluice.control.local import LocalWorkerPool, free_port


@dataclass
class Sample:
    kind: str  # short, long, trace
    ttft: float
    tpot: float | None  # None: a single token
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    seconds: float = 0.0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# --- processes ------------------------------------------------------------------------------


def start_workers(stack: ExitStack, roles: list[str], args: argparse.Namespace
                  ) -> list[tuple[str, str, str | None]]:
    """One `sluice worker` per role; (url, role, kv-events endpoint) each."""
    out = []
    base = ["--model", args.model_path, "--max-model-len", "4096", *args.worker_arg]
    env = {"OMP_NUM_THREADS": "1"}
    pools = [LocalWorkerPool(1, [*base, "--role", role], kv_events=True, env=env,
                             startup_timeout_s=300) for role in roles]
    for pool, role in zip(pools, roles, strict=True):
        stack.enter_context(pool)
        out.append((pool.urls[0], role, pool.kv_endpoints[0]))
    return out


def start_router(stack: ExitStack, workers: list[tuple[str, str, str | None]],
                 pd_args: list[str], args: argparse.Namespace) -> str:
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "router", "--policy", "cost", "--port", str(port),
           "--log-level", "warning", "--seed", "0", "--tokenizer", args.model_path, *pd_args]
    for url, role, kv in workers:
        flag = {"prefill": "--prefill-worker", "decode": "--decode-worker"}.get(role, "--worker")
        cmd += [flag, url] + (["--worker-kv-events", f"{url}={kv}"] if kv else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(lambda: (proc.terminate(), proc.wait(10)))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return url


def pd_counts(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("sluice_router_pd_requests_total{"):
            out[line.split('"')[1]] = float(line.split()[-1])
    return out


# --- clients ----------------------------------------------------------------------------------


async def stream_one(c: httpx.AsyncClient, model: str, kind: str, prompt: list[int],
                     max_tokens: int, run: Run) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    stamps: list[float] = []
    try:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                run.errors += 1
                print((await r.aread())[:300], file=sys.stderr)
                return
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as exc:
        run.errors += 1
        print(f"{kind}: {exc!r}", file=sys.stderr)
        return
    if not stamps:
        run.errors += 1
        return
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    run.samples.append(Sample(kind, stamps[0] - start, tpot, gaps, len(stamps)))


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def mixed_load(url: str, model: str, args: argparse.Namespace) -> Run:
    run = Run()
    rng = random.Random(args.seed)
    stop = time.perf_counter() + args.seconds

    async def decoder(c: httpx.AsyncClient, i: int) -> None:
        local = random.Random(args.seed * 1000 + i)
        while time.perf_counter() < stop:
            await stream_one(c, model, "short", random_ids(local, args.short_prompt),
                             args.short_tokens, run)

    async def longs(c: httpx.AsyncClient) -> None:
        tasks = []
        while True:
            await asyncio.sleep(args.long_every * rng.uniform(0.5, 1.5))
            if time.perf_counter() >= stop:
                break
            tasks.append(asyncio.create_task(stream_one(
                c, model, "long", random_ids(rng, args.long_tokens), args.long_out, run)))
        await asyncio.gather(*tasks)

    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        # warm-up: one of each, not counted
        await stream_one(c, model, "warm", random_ids(random.Random(-1), args.long_tokens), 2, Run())
        t0 = time.perf_counter()
        stop = t0 + args.seconds
        await asyncio.gather(longs(c), *(decoder(c, i) for i in range(args.decoders)))
        run.seconds = time.perf_counter() - t0
    return run


async def trace_load(url: str, model: str, reqs: list[tuple[float, list[int], int]]) -> Run:
    run = Run()
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:
        await stream_one(c, model, "warm", random_ids(random.Random(-1), 64), 2, Run())
        t0 = time.perf_counter()

        async def one(at: float, toks: list[int], n: int) -> None:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            await stream_one(c, model, "trace", toks, n, run)

        await asyncio.gather(*(one(at, t, n) for at, t, n in reqs))
        run.seconds = time.perf_counter() - t0
    return run


# --- summaries ---------------------------------------------------------------------------------


def summary(run: Run, args: argparse.Namespace, ttft_slo: float | None = None) -> dict[str, Any]:
    def good(s: Sample) -> bool:
        return (s.tpot is None or s.tpot <= args.tpot_slo) and \
            (ttft_slo is None or s.ttft <= ttft_slo)

    short = [s for s in run.samples if s.kind in ("short", "trace")]
    longs = [s for s in run.samples if s.kind == "long"]
    tpots = [s.tpot for s in short if s.tpot is not None]
    gaps = [g for s in short for g in s.gaps]
    tokens = sum(s.tokens for s in run.samples)
    return {
        "requests": len(run.samples), "errors": run.errors, "seconds": round(run.seconds, 2),
        "tpot_p50_s": pct(tpots, 0.5), "tpot_p99_s": pct(tpots, 0.99),
        "itl_p99_s": pct(gaps, 0.99),
        "ttft_p50_s": pct([s.ttft for s in short], 0.5),
        "ttft_p90_s": pct([s.ttft for s in short], 0.9),
        "long_ttft_p50_s": pct([s.ttft for s in longs], 0.5),
        "long_ttft_p90_s": pct([s.ttft for s in longs], 0.9),
        "goodput_rps": sum(map(good, run.samples)) / run.seconds if run.seconds else 0.0,
        "throughput_tokens_per_s": tokens / run.seconds if run.seconds else 0.0,
        "throughput_rps": len(run.samples) / run.seconds if run.seconds else 0.0,
    }


def model_id(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def part_mixed(args: argparse.Namespace) -> dict[str, Any]:
    configs = {"colocated": (["both", "both"], []),
               "pd": (["prefill", "decode"], ["--pd-mode", "conditional",
                                              "--pd-min-uncached-tokens",
                                              str(args.pd_threshold)])}
    out = {}
    for name, (roles, pd_args) in configs.items():
        with ExitStack() as stack:
            workers = start_workers(stack, roles, args)
            url = start_router(stack, workers, pd_args, args)
            run = asyncio.run(mixed_load(url, model_id(url), args))
            out[name] = summary(run, args) | {"pd_paths": pd_counts(url)}
        print(f"  mixed/{name} done", file=sys.stderr)
    return out


def part_trace(args: argparse.Namespace) -> dict[str, Any]:
    reqs = trace_prompts(args.trace, args.rows, args.every, args.trace_blocks, args.time_scale,
                         args.output_token_scale)
    out: dict[str, Any] = {"requests": len(reqs),
                           "mean_prompt_tokens": sum(len(t) for _, t, _ in reqs) / len(reqs)}
    for mode in ("conditional", "always", "never"):
        with ExitStack() as stack:
            workers = start_workers(stack, ["prefill", "decode"], args)
            url = start_router(stack, workers, ["--pd-mode", mode, "--pd-min-uncached-tokens",
                                                str(args.pd_threshold)], args)
            run = asyncio.run(trace_load(url, model_id(url), reqs))
            out[mode] = summary(run, args, ttft_slo=args.ttft_slo) | {"pd_paths": pd_counts(url)}
        print(f"  trace/{mode} done", file=sys.stderr)
    return out


def table(title: str, rows: dict[str, Any]) -> None:
    print(f"\n{title}")
    print(f"{'config':12} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>8} {'TTFT p50':>9} "
          f"{'long/TTFT p90':>13} {'goodput':>8} {'tok/s':>7} {'req/s':>6} {'err':>4}  paths")
    for name, r in rows.items():
        if not isinstance(r, dict):
            continue
        tail = r["long_ttft_p90_s"] if r["long_ttft_p90_s"] == r["long_ttft_p90_s"] \
            else r["ttft_p90_s"]
        print(f"{name:12} {r['tpot_p50_s']:9.3f} {r['tpot_p99_s']:9.3f} {r['itl_p99_s']:8.3f} "
              f"{r['ttft_p50_s']:9.3f} {tail:13.3f} {r['goodput_rps']:8.3f} "
              f"{r['throughput_tokens_per_s']:7.1f} {r['throughput_rps']:6.2f} {r['errors']:4d}"
              f"  {r['pd_paths']}")


def plot(results: dict[str, Any], path: str, tpot_slo: float) -> None:
    """TPOT p99 and goodput per configuration, one panel per part (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("mixed", "trace") if p in results]
    fig, axes = plt.subplots(1, 2 * len(parts), figsize=(4.2 * 2 * len(parts), 3.4))
    for i, part in enumerate(parts):
        rows = {k: v for k, v in results[part].items() if isinstance(v, dict)}
        names = list(rows)
        ax = axes[2 * i]
        ax.bar(names, [rows[n]["tpot_p99_s"] * 1e3 for n in names], color="#4c72b0")
        ax.axhline(tpot_slo * 1e3, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{part}: decode TPOT p99 (ms)")
        ax = axes[2 * i + 1]
        ax.bar(names, [rows[n]["goodput_rps"] for n in names], color="#55a868")
        ax.set_title(f"{part}: goodput (req/s in SLO)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["mixed", "trace"], choices=["mixed", "trace"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="more `sluice worker` flags (repeat), e.g. the KV connector's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tpot-slo", type=float, default=0.05, help="seconds per output token")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="trace part: seconds")
    ap.add_argument("--plot", default=None, metavar="PNG", help="also draw the results here")
    ap.add_argument("--pd-threshold", type=int, default=256,
                    help="--pd-min-uncached-tokens of the disaggregated router")
    g = ap.add_argument_group("mixed")
    g.add_argument("--seconds", type=float, default=60.0)
    g.add_argument("--decoders", type=int, default=4)
    g.add_argument("--short-prompt", type=int, default=32)
    g.add_argument("--short-tokens", type=int, default=48)
    g.add_argument("--long-tokens", type=int, default=1200)
    g.add_argument("--long-out", type=int, default=8)
    g.add_argument("--long-every", type=float, default=4.0)
    g = ap.add_argument_group("trace")
    g.add_argument("--trace", default="/work/shared/traces/mooncake_synthetic_trace.jsonl")
    g.add_argument("--rows", type=int, default=4000)
    g.add_argument("--every", type=int, default=15)
    g.add_argument("--trace-blocks", type=int, default=32)
    g.add_argument("--time-scale", type=float, default=0.1)
    g.add_argument("--output-token-scale", type=float, default=0.05)
    args = ap.parse_args()

    from sluice.engine.tokenizer import resolve_model

    args.model_path = resolve_model(args.model)
    results: dict[str, Any] = {}
    if "mixed" in args.parts:
        results["mixed"] = part_mixed(args)
        table(f"(a) mixed: {args.decoders} short streams + a {args.long_tokens}-token prompt "
              f"every ~{args.long_every:g} s, {args.seconds:g} s; goodput: TPOT <= "
              f"{args.tpot_slo:g} s", results["mixed"])
    if "trace" in args.parts:
        results["trace"] = part_trace(args)
        table(f"(b) Mooncake trace, {results['trace']['requests']} requests, "
              f"{results['trace']['mean_prompt_tokens']:.0f} prompt tokens on average; "
              f"goodput: TTFT <= {args.ttft_slo:g} s and TPOT <= {args.tpot_slo:g} s",
              results["trace"])
    if args.plot:
        plot(results, args.plot, args.tpot_slo)
    print(json.dumps({"benchmark": "pd", "cpu": cpu_name(), "cores": os.cpu_count(),
                      "args": {k: v for k, v in vars(args).items()}, "results": results}))
    return 0


if __name__ == "__main__":
    from router_policies import _exit_on_sigterm

    _exit_on_sigterm()
    raise SystemExit(main())
