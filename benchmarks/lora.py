"""Multi-LoRA throughput: N streams spread over K adapters vs the same streams on the base.

    flock /tmp/sluice-heavy.lock python benchmarks/lora.py            # 32 streams, 8 adapters

One engine (`enable_lora=True`, `max_loras=K`), the default SmolLM2-135M unless
`--model`. K adapters in PEFT format (rank `--rank`, all of q/k/v/o/gate/up/down,
random weights, written by this script into a temporary directory) are loaded and
warmed up first. Then, alternating for `--rounds` rounds: the workload on the base model
(no adapter), and the same workload with stream i on adapter i % K. Prompts are seeded
random token ids, greedy with `ignore_eos`, so both runs compute exactly the same number
of tokens. Reports output tokens/s of each and their ratio (best round of each); the last
stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, shapes: dict[str, tuple[int, int]], num_layers: int, rank: int,
                  seed: int) -> Path:
    """A PEFT-format adapter with random A and B (what peft's `save_pretrained` writes)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in TARGETS:
            d_in, d_out = shapes[module]
            sub = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
                else "mlp"
            key = f"base_model.model.model.layers.{layer}.{sub}.{module}.lora_"
            tensors[key + "A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in ** 0.5
            tensors[key + "B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
        "bias": "none", "lora_dropout": 0.0}))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/lora.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from sluice.engine.llm import LLM
    from sluice.engine.lora import LoRARequest
    from sluice.engine.sampling_params import SamplingParams

    llm = LLM(args.model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_num_seqs=args.streams)
    runner = llm.engine.runner
    rng = random.Random(args.seed)
    vocab = runner.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)]
               for _ in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"adapter-{k}", str(write_adapter(
            Path(tmp) / f"a{k}", runner.lora_shapes, runner.model_config.num_layers, args.rank,
            args.seed + k))) for k in range(args.adapters)]
        # warm-up: every adapter read, checked and put in a slot; the kernels warm
        llm.generate([prompts[0][:8]] * args.adapters, SamplingParams(max_tokens=2),
                     lora_request=loras)
        results: dict[str, list[float]] = {"base": [], "lora": []}
        for r in range(args.rounds):
            for kind in ("base", "lora"):
                per_stream = None if kind == "base" else \
                    [loras[i % args.adapters] for i in range(args.streams)]
                llm.engine.reset_prefix_cache()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, lora_request=per_stream)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                results[kind].append(tokens / elapsed)
                print(f"round {r} {kind}: {tokens} tokens in {elapsed:.2f}s = "
                      f"{tokens / elapsed:.1f} tok/s", file=sys.stderr)
    base, lora = max(results["base"]), max(results["lora"])
    slots = runner.lora_slots
    print(json.dumps({
        "model": args.model or "SmolLM2-135M-Instruct (default GGUF)", "streams": args.streams,
        "adapters": args.adapters, "rank": args.rank, "input_len": args.input_len,
        "output_len": args.output_len, "base_tok_s": round(base, 1),
        "lora_tok_s": round(lora, 1), "ratio": round(lora / base, 3),
        "all_rounds": {k: [round(v, 1) for v in vs] for k, vs in results.items()},
        "slot_loads": slots.loads if slots else 0, "cpu": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
