"""KV offload tiers: a multi-turn workload whose working set is several times the pool,
run on the same engine configuration without tiers and with them, in one run.

    python benchmarks/kv_offload.py [--sessions 8 --turns 4 --pool-blocks 64 ...]

Each session is a conversation: turn t's prompt is turn t-1's prompt, its answer and a
new user message (seeded random words). Each round sends every session's next turn at
once (the engine batches them, `--max-num-seqs`); between a session's turns the other
sessions push its blocks out of the pool. Without tiers a returning session recomputes
its whole history; with them it loads the blocks that went to the host tier (and the
disk tier, written through).

Reports per configuration TTFT p50/p90 (arrival to first token, in the engine), output
throughput over the run, prompt tokens hit, per-tier load bandwidth, the engine's
measured prefill cost per block, and where loading beats recomputing. The last stdout
line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.kv_offload import RedisTier
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.sampling_params import SamplingParams

WORDS = ("river stone market ledger window harbor signal copper meadow lantern engine "
         "orchard compass thunder velvet glacier saddle beacon quarry timber").split()


def user_message(rng: random.Random, words: int) -> str:
    return "User: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ".\nAssistant:"


def run_config(name: str, options: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig.from_options(args.model, **options)
    engine = LLMEngine(config)
    clear_store(engine)
    tok = engine.tokenizer
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    histories = [tok.encode(user_message(rng, args.first_words)) for _ in range(args.sessions)]
    # warm-up: one short request (first-touch costs), not measured
    engine.add_request("warm", tok.encode("Hello there"), params)
    while engine.has_unfinished_requests():
        engine.step()
    ttfts, cached, prompt_tokens, out_tokens = [], 0, 0, 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for s, history in enumerate(histories):
            engine.add_request(f"t{turn}s{s}", list(history), params)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        for s in range(args.sessions):
            out = finished[f"t{turn}s{s}"]
            m = out.metrics
            assert m is not None and m.first_token_time is not None
            if turn > 0:  # the first turn has nothing to reuse in either configuration
                ttfts.append(m.first_token_time - m.arrival_time)
                cached += out.num_cached_tokens
                prompt_tokens += len(out.prompt_token_ids)
            out_tokens += len(out.outputs[0].token_ids)
            histories[s] = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                            + tok.encode("\n" + user_message(rng, args.turn_words)))
    elapsed = time.perf_counter() - start
    tiers = engine.stats().kv_offload
    engine.core.close()
    ttfts.sort()
    result: dict[str, Any] = {
        "config": name, "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "output_tok_s": out_tokens / elapsed, "elapsed_s": elapsed,
        "prompt_hit_rate": cached / max(prompt_tokens, 1),
        "working_set_over_pool": sum(map(len, histories)) / (args.pool_blocks * args.block_size),
    }
    if tiers:
        result["tiers"] = tier_report(tiers, engine, args)
    return result


def clear_store(engine: LLMEngine) -> None:
    """Drop this model's blocks from the store: an earlier run's would hit in turn 0."""
    offload = engine.core.block_manager.offload
    for tier in offload.blob_tiers if offload is not None else []:
        if isinstance(tier, RedisTier):
            keys = list(tier.client.scan_iter(match=f"sluice:kv:{tier.namespace}:*"))
            if keys:
                tier.client.delete(*keys)


def tier_report(tiers: dict[str, dict[str, float]], engine: LLMEngine,
                args: argparse.Namespace) -> dict[str, Any]:
    """Per tier: blocks loaded, measured load bandwidth and time per block, and the
    break-even: loading a block pays when its load time is under the prefill time of its
    `block_size` tokens (both are measured by the engine, moving averages)."""
    prefill_block = tiers["ENGINE"]["prefill_s_per_block"]
    block_bytes = engine.core.block_manager.offload.pool.block_bytes  # type: ignore[union-attr]
    out: dict[str, Any] = {"prefill_s_per_block": prefill_block,
                           "break_even_GB_s": block_bytes / prefill_block / 1e9
                           if prefill_block else None}
    for medium, row in tiers.items():
        if medium == "ENGINE":
            continue
        bw = row["bytes_loaded"] / row["load_seconds"] if row["load_seconds"] else 0.0
        per_block = row["load_s_per_block"]
        out[medium] = {"hits": row["hits"], "load_GB_s": bw / 1e9,
                       "load_s_per_block": per_block,
                       "speedup_vs_recompute": prefill_block / per_block if per_block else None,
                       "errors": row["errors"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/kv_offload.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-words", type=int, default=200)
    p.add_argument("--turn-words", type=int, default=30)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--host", default="1GiB", help="host tier size")
    p.add_argument("--disk", default=None, help="disk tier DIR (default: a temporary one)")
    p.add_argument("--disk-size", default="4GiB")
    p.add_argument("--store", default="redis://127.0.0.1:6379/0",
                   help="shared store to measure as the only tier ('' to skip)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    base = {"num_kv_blocks": args.pool_blocks, "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs, "max_model_len": 2048}
    disk = args.disk or tempfile.mkdtemp(prefix="sluice-kv-bench-")
    configs = [("no tiers", base), ("host", {**base, "kv_offload": f"host={args.host}"}),
               ("disk", {**base, "kv_offload": f"disk={disk}:{args.disk_size}"})]
    if args.store:
        configs.append(("store", {**base, "kv_store": args.store}))
    try:
        results = [run_config(name, options, args) for name, options in configs]
    finally:
        if args.disk is None:
            shutil.rmtree(disk, ignore_errors=True)
    print(f"working set / pool: {results[0]['working_set_over_pool']:.1f}")
    print(f"{'config':<10} {'TTFT p50':>9} {'TTFT p90':>9} {'out tok/s':>10} {'hit rate':>9}")
    for r in results:
        print(f"{r['config']:<10} {r['ttft_p50_s']:>8.3f}s {r['ttft_p90_s']:>8.3f}s "
              f"{r['output_tok_s']:>10.1f} {r['prompt_hit_rate']:>9.2f}")
    for r in results[1:]:
        for medium, t in r["tiers"].items():
            if isinstance(t, dict):
                print(f"  {r['config']}: {medium} {t['hits']:.0f} blocks loaded at "
                      f"{t['load_GB_s']:.2f} GB/s, {t['load_s_per_block'] * 1e3:.3f} ms a block "
                      f"vs {r['tiers']['prefill_s_per_block'] * 1e3:.1f} ms to recompute it "
                      f"(loading pays above {r['tiers']['break_even_GB_s'] * 1e3:.0f} MB/s)")
    summary = {"results": results,
               "ttft_p50_ratio": {r["config"]: r["ttft_p50_s"] / results[0]["ttft_p50_s"]
                                  for r in results[1:]},
               "throughput_ratio": {r["config"]: r["output_tok_s"] / results[0]["output_tok_s"]
                                    for r in results[1:]},
               "working_set_over_pool": results[0]["working_set_over_pool"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
