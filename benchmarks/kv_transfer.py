"""P/D KV hand-off on loopback: how fast a prefill engine's KV reaches a decode engine,
against the time the prefill itself takes, in one run on the default model.

    python benchmarks/kv_transfer.py [--prompt-len 1000 --reps 3 --pulls 10 ...]

Two engines in this process (prefill and decode, each its own pool), the transfer over
TCP on 127.0.0.1 exactly as between two workers (the prefill engine's transfer server
thread, a pull thread on the decode side). Per repetition, a fresh seeded prompt of
`--prompt-len` tokens (no cache hit anywhere):

- prefill: the prefill engine computes the prompt and samples one token
  (`kv_transfer_params.do_remote_decode`), holding its blocks under a lease;
- hand-off: the decode engine's first token for the same request with the returned
  params: pull ((len - 1) // block_size blocks, checked), install in its pool, compute
  the last partial block, sample. `pull` is the transfer alone (the engine's
  `sluice:kv_transfer_seconds`); `hand-off` bounds what disaggregation adds to TTFT.

Then loopback bandwidth: `--pulls` pulls of the last prompt's held blocks (the lease
kept), bytes on the wire (blocks plus their small headers) over wall time.

Target (issue 13): hand-off <= 20% of the prompt's prefill time. The last stdout line
is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from typing import Any

from sluice.engine.kv_transfer import PullJob, _chain
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

WORDS = ("river stone market ledger window harbor signal copper meadow lantern engine "
         "orchard compass thunder velvet glacier saddle beacon quarry timber").split()
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prompt_ids(llm: LLM, rng: random.Random, length: int) -> list[int]:
    text = " ".join(rng.choice(WORDS) for _ in range(length * 2))
    ids = llm.get_tokenizer().encode(text)
    assert len(ids) >= length
    return ids[:length]


def timed(llm: LLM, prompt: list[int], kv: dict[str, Any] | None) -> tuple[float, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=1, kv_transfer_params=kv)
    start = time.perf_counter()
    (out,) = llm.generate([prompt], params)
    return time.perf_counter() - start, out


def pull_seconds(llm: LLM) -> float:
    return llm.engine.core.stats().kv_transfer["seconds_sum"]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "")
    return (f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} "
            f"CPUs, avx512_bf16={'yes' if 'avx512_bf16' in flags else 'no'}")


def bandwidth(p: LLM, d: LLM, prompt: list[int], params: dict[str, Any],
              pulls: int) -> dict[str, float]:
    """Pull the held blocks of `params` `pulls` times without ending the lease."""
    dt = d.engine.core.kv_transfer
    bs = d.engine.core.block_manager.block_size
    ids = list(params["remote_block_ids"])
    job = PullJob("bench", params, ids, _chain(prompt, bs, len(ids), b""), None)
    dt.connector.pull(job, done=False)  # warm-up
    start, nbytes = time.perf_counter(), 0
    for _ in range(pulls):
        nbytes += dt.connector.pull(job, done=False).nbytes
    seconds = time.perf_counter() - start
    return {"blocks": len(ids), "bytes_per_pull": nbytes / pulls,
            "seconds_per_pull": seconds / pulls, "gb_per_s": nbytes / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/kv_transfer.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="(default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pulls", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    opts = dict(num_kv_blocks=max(256, 4 * args.prompt_len // args.block_size),
                block_size=args.block_size, max_model_len=max(2048, 2 * args.prompt_len),
                dtype=args.dtype)
    p, d = LLM(args.model, **opts), LLM(args.model, **opts)
    rng = random.Random(args.seed)
    for llm in (p, d):  # warm-up: kernels, allocator
        timed(llm, prompt_ids(llm, rng, args.prompt_len), None)
    rows = []
    for _ in range(args.reps):
        prompt = prompt_ids(p, rng, args.prompt_len)
        prefill_s, out = timed(p, prompt, dict(PREFILL))
        params = out.kv_transfer_params
        before = pull_seconds(d)
        handoff_s, dout = timed(d, prompt, params)
        rows.append({"prefill_s": prefill_s, "handoff_s": handoff_s,
                     "pull_s": pull_seconds(d) - before,
                     "blocks": len(params["remote_block_ids"]),
                     "cached_tokens": dout.num_cached_tokens})
    prompt = prompt_ids(p, rng, args.prompt_len)
    _, out = timed(p, prompt, dict(PREFILL))
    bw = bandwidth(p, d, prompt, out.kv_transfer_params, args.pulls)
    med = {k: statistics.median(r[k] for r in rows) for k in ("prefill_s", "handoff_s",
                                                               "pull_s")}
    pool = d.engine.core.kv_transfer.pool
    summary = {
        "bench": "kv_transfer", "model": p.engine.model_name, "cpu": cpu_name(),
        "dtype": str(pool.dtype).removeprefix("torch."), "block_size": args.block_size,
        "prompt_len": args.prompt_len, "reps": args.reps, **{f"{k}_median": v
                                                             for k, v in med.items()},
        "handoff_over_prefill": med["handoff_s"] / med["prefill_s"],
        "pull_over_prefill": med["pull_s"] / med["prefill_s"],
        "target_handoff_over_prefill": 0.2, "loopback": bw, "rows": rows,
        "block_bytes": pool.block_bytes,
    }
    print(f"model {summary['model']} ({summary['dtype']}), {summary['cpu']}")
    print(f"{'prompt':>7} {'blocks':>7} {'prefill':>9} {'pull':>9} {'hand-off':>9} "
          f"{'hand-off/prefill':>17}")
    for r in rows:
        print(f"{args.prompt_len:>7} {r['blocks']:>7} {r['prefill_s'] * 1e3:>7.1f}ms "
              f"{r['pull_s'] * 1e3:>7.1f}ms {r['handoff_s'] * 1e3:>7.1f}ms "
              f"{r['handoff_s'] / r['prefill_s']:>16.1%}")
    print(f"loopback: {bw['blocks']} blocks ({bw['bytes_per_pull'] / 1e6:.1f} MB) per pull in "
          f"{bw['seconds_per_pull'] * 1e3:.1f} ms: {bw['gb_per_s']:.2f} GB/s")
    print(json.dumps(summary))
    for llm in (p, d):
        llm.engine.core.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
