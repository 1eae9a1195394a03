"""Structured output's cost in the engine, against the same engine unconstrained, one run.

    flock /tmp/sluice-heavy.lock python benchmarks/structured_output.py [--model M]
        [--backend auto|xgrammar|guidance]

1. Throughput: 32 requests at once under a JSON schema whose output is ~180 tokens,
   then the same prompts unconstrained, each with `max_tokens` = its constrained
   output's length (`ignore_eos`), so both runs do the same work per request and the
   batch empties the same way, each on an empty prefix cache, alternated 5 times after a full-batch warm-up;
   median output tokens/s of each and their ratio (target >= 0.9),
   and the mask time (one batched bitmask fill + apply per step) per step and per
   token, p50 / p99 (target p99 <= 1 ms per token).
2. Compile isolation: unconstrained requests arriving open-loop (Poisson) with and
   without slow-to-compile schemas arriving beside them (each unique, so each one
   compiles, on the core's compile thread); TTFT p50 / p99 of the unconstrained
   requests in both runs and their ratio (target: p99 raised by <= 10%).
3. Compile and the GIL: a slow schema compiled alone, with a Python thread counting
   beside it, against the same thread beside GIL-free C (SHA-256) of one core: ~1.00
   means the compile leaves the GIL free, so only its CPU time competes with a step.

`--parts 2,3` runs only those parts.

Prints a table per part; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import threading
import time
from typing import Any

from sluice.engine.config import STRUCTURED_OUTPUTS_BACKENDS
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams, StructuredOutputsParams
from sluice.engine.structured_output import BACKENDS, resolve_backend

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"}}, "required": ["name", "qty", "ok"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "items": ITEM, "minItems": 8, "maxItems": 8}},
    "required": ["items"], "additionalProperties": False}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prompts(llm: LLM, count: int) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"Order #{i}: list eight "
                                                                 "items as JSON."}])
            for i in range(count)]


def timed_generate(llm: LLM, texts: list[str],
                   params: SamplingParams | list[SamplingParams]) -> tuple[float, int, Any]:
    start = time.perf_counter()
    outs = llm.generate(texts, params)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(c.token_ids) for o in outs for c in o.outputs), outs


def throughput(llm: LLM, batch: int, rounds: int) -> dict[str, Any]:
    """Constrained and unconstrained runs alternated `rounds` times (ABAB: a drift of a
    shared machine hits both), each on an empty prefix cache; medians reported."""
    texts = prompts(llm, batch)
    schema = StructuredOutputsParams.from_schema(ORDER, "response_format")
    # warm: the schema's compile, and the full batch's shapes in both paths
    llm.generate(texts, SamplingParams(temperature=1.0, max_tokens=32, structured_outputs=schema))
    llm.generate(texts, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True))
    manager = llm.engine.core.structured
    manager.mask_samples.clear()
    constrained, unconstrained, valid, lengths = [], [], 0, [0]
    for _ in range(rounds):
        llm.engine.reset_prefix_cache()
        c_time, c_tokens, outs = timed_generate(
            llm, texts, SamplingParams(temperature=1.0, seed=0, max_tokens=400,
                                       structured_outputs=schema))
        constrained.append(c_tokens / c_time)
        valid = sum(1 for o in outs if o.outputs[0].finish_reason == "stop")
        lengths = [len(o.outputs[0].token_ids) for o in outs]  # the same work per request
        llm.engine.reset_prefix_cache()
        u_time, u_tokens, _ = timed_generate(
            llm, texts, [SamplingParams(temperature=1.0, seed=0, max_tokens=n, ignore_eos=True)
                         for n in lengths])
        unconstrained.append(u_tokens / u_time)
    steps = [s for s, _ in manager.mask_samples]
    per_token = [s / rows for s, rows in manager.mask_samples]
    c_tok_s, u_tok_s = statistics.median(constrained), statistics.median(unconstrained)
    return {"batch": batch, "rounds": rounds, "constrained_tok_s": c_tok_s,
            "unconstrained_tok_s": u_tok_s, "ratio": c_tok_s / u_tok_s,
            "ratios": [c / u for c, u in zip(constrained, unconstrained, strict=True)],
            "mean_output_tokens": sum(lengths) // batch, "finished_by_grammar": valid,
            "mask_ms_per_step_p50": 1e3 * pct(steps, 0.5),
            "mask_ms_per_step_p99": 1e3 * pct(steps, 0.99),
            "mask_ms_per_token_p50": 1e3 * pct(per_token, 0.5),
            "mask_ms_per_token_p99": 1e3 * pct(per_token, 0.99)}


def slow_schema(seed: int) -> StructuredOutputsParams:
    props = {f"p{seed}_{i}": {"anyOf": [
        {"type": "string", "pattern": f"[a-z]{{1,{i % 7 + 2}}}"},
        {"type": "integer", "minimum": i, "maximum": i * 1000 + seed}]} for i in range(60)}
    return StructuredOutputsParams.from_schema(
        {"type": "object", "properties": props, "required": list(props)}, "response_format")


def open_loop_ttft(llm: LLM, rate: float, count: int, slow_every: float | None) -> list[float]:
    """TTFT of `count` unconstrained requests arriving at `rate`/s; with `slow_every`,
    a unique slow-to-compile schema request arrives every that many seconds too."""
    engine, rng = llm.engine, random.Random(1)
    tok = llm.get_tokenizer()
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    arrivals, t = [], 0.0
    for _ in range(count):
        t += rng.expovariate(rate)
        arrivals.append(t)
    start, sent, next_slow, slow_id = time.perf_counter(), 0, 0.0, 0
    first: dict[str, float] = {}
    while len(first) < count:
        now = time.perf_counter() - start
        while sent < count and arrivals[sent] <= now:
            prompt = tok.encode(f"Request {sent}: tell me a short story about the sea.")
            engine.add_request(f"p{sent}", prompt, plain, arrival_time=start + arrivals[sent])
            sent += 1
        if slow_every is not None and now >= next_slow and sent < count:
            slow_id += 1
            engine.add_request(f"slow{slow_id}", tok.encode("JSON please"), SamplingParams(
                max_tokens=8, structured_outputs=slow_schema(slow_id)))
            next_slow = now + slow_every
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for out in engine.step():
            rid = out.request_id
            if rid.startswith("p") and rid not in first and out.outputs[0].token_ids:
                first[rid] = time.perf_counter() - start - arrivals[int(rid[1:])]
    while engine.has_unfinished_requests():
        engine.step()
    return list(first.values())


def compile_gil(llm: LLM, backend: str, count: int = 3) -> dict[str, float]:
    """Part 3: a slow schema's compile, timed alone, with a pure-Python thread counting
    beside it; the same thread beside SHA-256 (C that releases the GIL) is the reference
    for "GIL free, one core busy". Their ratio is ~1 when the compile leaves the GIL free
    and well under 1 when it holds it (CPU contention from other work hits both alike)."""
    tok = llm.get_tokenizer()
    grammar = BACKENDS[resolve_backend(backend, slow_schema(10_000))](
        tok, llm.engine.core.info.vocab_size)
    data = os.urandom(32 << 20)
    times, shares = [], []
    for i in range(count):
        compile_s, compile_rate = _counted_beside(
            lambda i=i: grammar.compile(slow_schema(10_001 + i)))
        _, free_rate = _counted_beside(lambda: hashlib.sha256(data).digest())
        times.append(compile_s)
        shares.append(min(1.0, compile_rate / free_rate))
    return {"compile_ms_median": 1e3 * statistics.median(times),
            "gil_free_share_median": statistics.median(shares)}


def _counted_beside(fn: Any) -> tuple[float, float]:
    """(seconds `fn` took, counts per second a Python thread made meanwhile)."""
    stop, counts = threading.Event(), [0]

    def spin() -> None:
        while not stop.is_set():
            counts[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    return elapsed, counts[0] / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--backend", default="auto", choices=STRUCTURED_OUTPUTS_BACKENDS,
                        help="structured_outputs_backend (default: %(default)s)")
    parser.add_argument("--parts", default="1,2,3", help="which parts to run (default: all)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="ABAB rounds of part 1")
    parser.add_argument("--rate", type=float, default=4.0, help="plain arrivals per second")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--slow-every", type=float, default=1.0,
                        help="seconds between slow-to-compile schema arrivals")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    llm = LLM(args.model, max_num_seqs=max(args.batch, 32), num_kv_blocks=2048,
              structured_outputs_backend=args.backend)
    print(f"backend {args.backend}")
    result: dict[str, Any] = {"benchmark": "structured_output", "backend": args.backend,
                              "cpu": platform.processor() or platform.machine()}
    if "1" in parts:
        result["throughput"] = report_throughput(throughput(llm, args.batch, args.rounds))
    if "2" in parts:
        result["compile_isolation"] = report_isolation(isolation(llm, args))
    if "3" in parts:
        part3 = result["compile"] = compile_gil(llm, args.backend)
        print(f"\nslow schema compile {part3['compile_ms_median']:.1f} ms (median of 3); a "
              f"Python thread beside it ran {part3['gil_free_share_median']:.2f}x as fast as "
              "beside GIL-free C (1.00: the compile leaves the GIL free)")
    print(json.dumps(result))
    return 0


def report_throughput(part1: dict[str, Any]) -> dict[str, Any]:
    print(f"{'run':<16}{'tok/s':>10}")
    print(f"{'json schema':<16}{part1['constrained_tok_s']:>10.1f}")
    print(f"{'unconstrained':<16}{part1['unconstrained_tok_s']:>10.1f}")
    print(f"ratio {part1['ratio']:.3f} (target >= 0.9; rounds "
          f"{', '.join(f'{r:.3f}' for r in part1['ratios'])}); mean output "
          f"{part1['mean_output_tokens']} tokens; {part1['finished_by_grammar']}/"
          f"{part1['batch']} ended by the grammar")
    print(f"mask per step p50 {part1['mask_ms_per_step_p50']:.3f} ms, p99 "
          f"{part1['mask_ms_per_step_p99']:.3f} ms; per token p50 "
          f"{part1['mask_ms_per_token_p50']:.3f} ms, p99 {part1['mask_ms_per_token_p99']:.3f} ms")
    return part1


def isolation(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    open_loop_ttft(llm, args.rate, 8, None)  # warm
    base = open_loop_ttft(llm, args.rate, args.requests, None)
    slow = open_loop_ttft(llm, args.rate, args.requests, args.slow_every)
    part2 = {"rate": args.rate, "requests": args.requests, "slow_every_s": args.slow_every,
             "ttft_p50_ms": 1e3 * statistics.median(base),
             "ttft_p99_ms": 1e3 * pct(base, 0.99),
             "ttft_p50_ms_with_slow": 1e3 * statistics.median(slow),
             "ttft_p99_ms_with_slow": 1e3 * pct(slow, 0.99)}
    part2["p99_ratio"] = part2["ttft_p99_ms_with_slow"] / part2["ttft_p99_ms"]
    return part2


def report_isolation(part2: dict[str, Any]) -> dict[str, Any]:
    print(f"\n{'unconstrained TTFT':<26}{'p50 ms':>10}{'p99 ms':>10}")
    print(f"{'alone':<26}{part2['ttft_p50_ms']:>10.1f}{part2['ttft_p99_ms']:>10.1f}")
    print(f"{'beside slow compiles':<26}{part2['ttft_p50_ms_with_slow']:>10.1f}"
          f"{part2['ttft_p99_ms_with_slow']:>10.1f}")
    print(f"p99 ratio {part2['p99_ratio']:.3f} (target <= 1.10)")
    return part2


if __name__ == "__main__":
    raise SystemExit(main())
