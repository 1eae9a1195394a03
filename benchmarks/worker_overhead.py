"""What the HTTP server costs: TTFT and output tokens/s through `sluice worker` vs the
same engine called directly (AsyncEngine in this process, no HTTP).

Both sides load the same model with the same options; the worker runs as a real
`sluice worker` subprocess, the direct engine in this process. Requests alternate
between the two (direct, http, direct, http, ...) so machine noise hits both alike;
each side gets a warm-up. Two phases: sequential requests (latency: TTFT, per-request
decode speed) and `--concurrency` requests at once (aggregate output tokens/s).

    python benchmarks/worker_overhead.py [--model M] [--requests 8] [--prompt-tokens 256]
                                         [--max-tokens 64] [--concurrency 8]

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
from dataclasses import dataclass
from typing import Any

import httpx

from sluice.control.local import free_port
from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams

WORDS = ("river stone cloud lantern orbit meadow copper signal harbor violet engine quiet "
         "summer ladder pixel forest canyon ember glacier thunder").split()


@dataclass
class Sample:
    ttft: float
    e2e: float
    tokens: int

    @property
    def decode_tps(self) -> float:
        return (self.tokens - 1) / max(self.e2e - self.ttft, 1e-9)


def prompts(engine: AsyncEngine, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(length * 2))
        out.append(engine.tokenizer.encode(text)[:length])
    return out


async def direct(engine: AsyncEngine, ids: list[int], max_tokens: int, rid: str) -> Sample:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    start = time.perf_counter()
    first, tokens = 0.0, 0
    async for out in engine.generate(ids, params, rid):
        n = len(out.outputs[0].token_ids)
        if n and not tokens:
            first = time.perf_counter() - start
        tokens += n
    return Sample(first, time.perf_counter() - start, tokens)


async def http(client: httpx.AsyncClient, ids: list[int], max_tokens: int) -> Sample:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = 0.0, 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and not first:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return Sample(first, time.perf_counter() - start, tokens)


def start_worker(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "sluice.cli", "worker", "--port", str(port),
           "--log-level", "warning", "--max-model-len", str(args.max_model_len)]
    if args.model:
        cmd += ["--model", args.model]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


async def wait_healthy(client: httpx.AsyncClient, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("worker did not become healthy")


def summary(samples: list[Sample]) -> dict[str, float]:
    return {"ttft_ms_median": 1000 * statistics.median(s.ttft for s in samples),
            "decode_tok_s_median": statistics.median(s.decode_tps for s in samples),
            "e2e_s_median": statistics.median(s.e2e for s in samples)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    proc = start_worker(args, port)
    try:
        config = EngineConfig.from_options(args.model, max_model_len=args.max_model_len)
        engine = await asyncio.to_thread(AsyncEngine, config)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            await wait_healthy(client)
            ps = prompts(engine, args.requests + args.concurrency + 1, args.prompt_tokens,
                         args.seed)
            await direct(engine, ps[-1], 4, "warm")
            await http(client, ps[-1], 4)
            seq_d, seq_h = [], []
            for i in range(args.requests):
                seq_d.append(await direct(engine, ps[i], args.max_tokens, f"d{i}"))
                seq_h.append(await http(client, ps[i], args.max_tokens))
            conc = ps[args.requests:args.requests + args.concurrency]
            t0 = time.perf_counter()
            batch_d = await asyncio.gather(*(direct(engine, p, args.max_tokens, f"c{i}")
                                             for i, p in enumerate(conc)))
            direct_wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            batch_h = await asyncio.gather(*(http(client, p, args.max_tokens) for p in conc))
            http_wall = time.perf_counter() - t0
        engine.shutdown()
    finally:
        proc.terminate()
        proc.wait(60)
    d, h = summary(seq_d), summary(seq_h)
    return {
        "sequential": {"direct": d, "http": h,
                       "ttft_overhead_ms": h["ttft_ms_median"] - d["ttft_ms_median"],
                       "decode_tok_s_ratio_http_over_direct":
                           h["decode_tok_s_median"] / d["decode_tok_s_median"]},
        "concurrent": {"concurrency": args.concurrency,
                       "direct_tok_s": sum(s.tokens for s in batch_d) / direct_wall,
                       "http_tok_s": sum(s.tokens for s in batch_h) / http_wall},
        "config": vars(args),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    result = asyncio.run(run(args))
    seq, conc = result["sequential"], result["concurrent"]
    print(f"{'':28}{'direct':>12}{'http':>12}")
    for key, label in (("ttft_ms_median", "TTFT median (ms)"),
                       ("decode_tok_s_median", "decode tok/s median"),
                       ("e2e_s_median", "e2e median (s)")):
        print(f"{label:28}{seq['direct'][key]:12.2f}{seq['http'][key]:12.2f}")
    print(f"{'concurrent output tok/s':28}{conc['direct_tok_s']:12.2f}{conc['http_tok_s']:12.2f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
