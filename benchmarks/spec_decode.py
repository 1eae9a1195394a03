"""Speculative decoding against plain decoding, same engine, same weights, one run.

    flock /tmp/sluice-heavy.lock python benchmarks/spec_decode.py [--model M]
        [--methods ngram suffix draft_model] [--output-len 192] [--streams 32]
        [--draft-layers 4] [--draft-k 4] [--quantization gguf] [--dtype float32]

1. Input-grounded, one stream: chat prompts that ask the model to repeat, edit or
   continue a given text or code (the output copies long runs of the input); greedy,
   each request alone; output tokens/s of plain decoding and of each method
   (target >= 2x), the acceptance counters, and whether the outputs were identical.
2. Random, `--streams` at once: random-token prompts, ignore_eos, greedy; plain against
   each method with the adaptive planner on (target >= 0.95x: it must not hurt).

`draft_model` needs a smaller model with the default model's tokenizer; there is none
here, so the draft is a truncated copy of the target (a LayerSkip-style self-draft):
its first `--draft-layers` layers, the final norm and the (tied) LM head, written as a
checkpoint directory (`truncated_draft`, `--draft-dir`, default under /tmp), drafting
`--draft-k` tokens deep. The table also reports the seconds spent in draft forwards.

The plain runs use the same loaded engine with its `SpecDecoder` detached, so weights,
KV pool and kernels are shared. Runs alternate `--repeats` times, even repeats in the
order plain, methods, odd ones in reverse (so a drifting host tilts no method); the
rates are medians, each method's speed-up the median of its passes' ratios to the plain
run of the same pass. The suffix proposer forgets earlier requests' outputs before each
pass (the passes repeat the same prompts; within a pass it learns as it goes). Last
stdout line: one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

TEXT = ("The river had been rising for three days when the ferryman finally agreed to "
        "take us across. He said the current was stronger than it looked, that the "
        "water near the far bank hid a line of old posts from the bridge that burned "
        "down before his father was born, and that we should sit still and keep our "
        "hands inside the boat. We did as he said. Halfway across, the fog lifted and "
        "we could see the village on the hill, its windows bright with morning sun.")
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over window items."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2
'''
GROUNDED = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Rewrite this code with the function renamed to rolling_mean. Output the whole "
    f"code:\n\n{CODE}",
    f"Copy this paragraph, replacing 'ferryman' with 'boatman':\n\n{TEXT}",
    f"Here is some Python code:\n\n{CODE}\nRepeat the code above exactly.",
]


def grounded_prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                       add_special_tokens=False) for p in GROUNDED]


def truncated_draft(model: str | None, layers: int, out: Path) -> Path:
    """A Hugging Face checkpoint of the GGUF `model`'s first `layers` layers (dequantized
    to float32, Q/K un-permuted), its final norm and LM head; no tokenizer (a draft uses
    the target's). Written once; reused if `out` has it."""
    import torch
    from safetensors.torch import save_file

    from sluice.engine.models.gguf_file import read_gguf
    from sluice.engine.models.gguf_loader import config_from_gguf, convert_weights
    from sluice.engine.tokenizer import local_model_path

    if (out / "model.safetensors").is_file():
        return out
    gguf = read_gguf(local_model_path(model))
    cfg, permuted = config_from_gguf(gguf)
    if cfg.rope.rope_type not in ("default", "none") or layers >= cfg.num_layers:
        raise SystemExit(f"cannot truncate {model} to {layers} layers")
    keep = {f"model.layers.{i}." for i in range(layers)}
    weights = {name: w.contiguous().to(torch.float32)
               for name, w in convert_weights(gguf, cfg, permuted).items()
               if not name.startswith("model.layers.") or name[:name.index(".", 13) + 1] in keep}
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    config = {"architectures": [cfg.architecture], "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_hidden_layers": layers, "num_attention_heads": cfg.num_heads,
              "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
              "rms_norm_eps": cfg.rms_norm_eps,
              "max_position_embeddings": cfg.max_position_embeddings,
              "rope_theta": cfg.rope.theta, "tie_word_embeddings": cfg.tie_word_embeddings,
              "hidden_act": "silu"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, spec: Any, prompts: list[list[int]], params: SamplingParams,
        one_at_a_time: bool, tag: str) -> tuple[float, list[list[int]], dict[str, Any]]:
    """(output tokens/s, outputs, spec counters of this run) with `spec` attached."""
    engine = llm.engine
    core = engine.core
    core.spec = spec
    before = dict(spec.stats()) if spec is not None else {}
    draft_before = getattr(spec.proposer, "seconds", 0.0) if spec is not None else 0.0
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    outputs: list[list[int]] = []
    tokens, start = 0, time.perf_counter()
    for b, batch in enumerate(batches):
        for i, prompt in enumerate(batch):
            engine.add_request(f"{tag}-{b}-{i}", prompt, params)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        for i in range(len(batch)):
            outputs.append(done[f"{tag}-{b}-{i}"])
            tokens += len(done[f"{tag}-{b}-{i}"])
    seconds = time.perf_counter() - start
    counters: dict[str, Any] = {}
    if spec is not None:
        after = spec.stats()
        counters = {k: after[k] - before[k] for k in
                    ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        counters["draft_seconds"] = getattr(spec.proposer, "seconds", 0.0) - draft_before
    core.block_manager.reset_prefix_cache()
    return tokens / seconds, outputs, counters


def bench(llm: LLM, specs: dict[str, Any], prompts: list[list[int]], params: SamplingParams,
          one_at_a_time: bool, repeats: int, label: str) -> dict[str, Any]:
    rates: dict[str, list[float]] = {name: [] for name in ["plain", *specs]}
    counters: dict[str, dict[str, int]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(repeats):
        # ABBA: odd repeats run the methods in reverse, so a host that slows (or speeds
        # up) during the run tilts no method's median
        for name in (list(rates) if r % 2 == 0 else list(rates)[::-1]):
            spec = specs.get(name)
            if spec is not None and hasattr(spec.proposer, "reset"):
                spec.proposer.reset()  # suffix: no drafts from the last pass's answers
            rate, outs, count = run(llm, spec, prompts, params, one_at_a_time,
                                    f"{label}-{name}-{r}")
            rates[name].append(rate)
            outputs[name] = outs
            for k, v in count.items():
                counters.setdefault(name, {}).setdefault(k, 0)
                counters[name][k] += v
            print(f"  {label} {name} run {r}: {rate:.1f} tok/s", flush=True)
    medians = {name: statistics.median(v) for name, v in rates.items()}
    # each pass's ratio to the plain run of the same pass, then their median: the host's
    # speed drifts between passes (3x within one run, 2026-12-04), less within one
    paired = {n: [a / b for a, b in zip(rates[n], rates["plain"], strict=True)] for n in specs}
    return {"tok_s": medians,
            "speedup": {n: statistics.median(v) for n, v in paired.items()},
            "speedup_per_pass": paired,
            "identical_to_plain": {n: outputs[n] == outputs["plain"] for n in specs},
            "counters": counters,
            "acceptance": {n: c["num_accepted_tokens"] / max(c["num_draft_tokens"], 1)
                           for n, c in counters.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix"],
                    choices=["ngram", "suffix", "draft_model"])
    ap.add_argument("--draft-layers", type=int, default=4,
                    help="draft_model: layers of the target kept in the self-draft")
    ap.add_argument("--not-adaptive", action="store_true",
                    help="draft on every step (the planner off): raw acceptance and cost")
    ap.add_argument("--draft-dir", default=None,
                    help="draft_model: where the self-draft checkpoint is written (/tmp/...)")
    ap.add_argument("--draft-k", type=int, default=4,
                    help="draft_model: num_speculative_tokens")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="none",
                    help="the engine's --quantization (gguf: one stream's steps, verifies "
                         "of up to 8 rows included, run as the decode graph)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    k = args.num_speculative_tokens
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": k,
                         "prompt_lookup_min": 2, "prompt_lookup_max": 5},
               "suffix": {"method": "suffix", "num_speculative_tokens": k}}
    if "draft_model" in args.methods:
        out = Path(args.draft_dir or f"/tmp/sluice-selfdraft-{args.draft_layers}l-"
                   f"{os.path.basename(args.model or 'default')}")
        configs["draft_model"] = {
            "method": "draft_model", "num_speculative_tokens": args.draft_k,
            "model": str(truncated_draft(args.model, args.draft_layers, out))}
    if args.not_adaptive:
        for config in configs.values():
            config["adaptive"] = False
    llm = LLM(args.model, max_num_seqs=max(args.streams, 1),
              speculative_config=configs[args.methods[0]], quantization=args.quantization,
              dtype=args.dtype)
    from sluice.engine.spec_decode import PROPOSERS, SpecDecoder

    core = llm.engine.core
    first = core.spec
    specs: dict[str, Any] = {}
    for name in args.methods:
        if name == args.methods[0]:
            spec = first
        else:
            config = llm.config.speculative.__class__(**configs[name])
            spec = SpecDecoder(config, core.sampler, core.block_manager,
                               core.info.max_model_len,
                               PROPOSERS[name]().from_engine(config, llm.config, core.runner))
            spec.planner.cost = first.planner.cost  # the same step-time curve
            spec.graph_rows = first.graph_rows  # verifies capped to the decode graph's rows
            spec.proposer.calibrate(max(args.streams, 1))
        specs[name] = spec
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len)
    warm = grounded_prompts(llm)[:1]
    run(llm, None, warm, SamplingParams(temperature=0.0, max_tokens=16), True, "warm")
    print(f"# spec decode bench: {platform.processor() or platform.machine()}, "
          f"model {llm.engine.model_name}", flush=True)
    grounded = bench(llm, specs, grounded_prompts(llm), greedy, True, args.repeats,
                     "grounded-1")
    rand = random_prompts(args.streams, args.random_input_len, llm.engine.core.info.vocab_size,
                          0)
    rparams = SamplingParams(temperature=0.0, max_tokens=args.random_output_len,
                             ignore_eos=True)
    random_res = bench(llm, specs, rand, rparams, False, args.repeats,
                       f"random-{args.streams}")
    print(f"\n{'workload':<22}{'engine':<12}{'tok/s':>9}{'x plain':>9}{'accept':>8}"
          f"{'identical':>10}{'draft s':>9}")
    for label, res in (("grounded, 1 stream", grounded),
                       (f"random, {args.streams} streams", random_res)):
        for name, rate in res["tok_s"].items():
            x = res["speedup"].get(name, 1.0)
            acc = res["acceptance"].get(name)
            same = res["identical_to_plain"].get(name, "")
            secs = res["counters"].get(name, {}).get("draft_seconds")
            print(f"{label:<22}{name:<12}{rate:>9.1f}{x:>9.2f}"
                  f"{'' if acc is None else f'{acc:.2f}':>8}{str(same):>10}"
                  f"{'' if not secs else f'{secs:.1f}':>9}")
    print(json.dumps({"grounded_single_stream": grounded, "random": random_res,
                      "streams": args.streams, "output_len": args.output_len,
                      "num_speculative_tokens": k}))


if __name__ == "__main__":
    main()
