"""Mixture-of-experts models offline, sluice against transformers in the same run, on a
random checkpoint of a real model's shape (no hub here: the weights are random, the
arithmetic and the memory traffic are the real model's).

    python benchmarks/moe.py                                  # granite-3.1-1b-a400m's shape
    python benchmarks/moe.py --shape qwen3-moe-2b --batch 16 --quantization int8 --peer none

The checkpoint is written once under `--dir` (default: the system temp folder), with
SmolLM2's tokenizer (vocabulary 49,152), then `sluice bench offline --model DIR` runs one
stream (`--single-stream`) and each `--batch`, transformers beside it (`--peer`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from sluice.bench import offline

# config.json fields of real models (the vocabulary is SmolLM2's, whose tokenizer is used)
SHAPES: dict[str, dict[str, object]] = {
    # ibm-granite/granite-3.1-1b-a400m-instruct: 1.3B parameters, 400M active a token
    "granite-1b-a400m": dict(
        model_type="granitemoe", hidden_size=1024, intermediate_size=512,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=8,
        num_local_experts=32, num_experts_per_tok=8, max_position_embeddings=4096,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=6.0, rope_theta=10000.0, tie_word_embeddings=True),
    # a Qwen3-MoE cut to 2B parameters (Qwen3-30B-A3B's expert count and widths, 8 layers)
    "qwen3-moe-2b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=8, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=4096, rope_theta=1000000.0,
        tie_word_embeddings=False),
}


def make_checkpoint(shape: str, directory: Path) -> Path:
    """A random checkpoint of `shape` (transformers' own init, seed 0) in float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = directory / f"sluice-moe-{shape}"
    if (out / "config.json").is_file():
        return out
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(str(fields.pop("model_type")), vocab_size=49152,
                                  bos_token_id=1, eos_token_id=2, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_models import save_smollm2_tokenizer  # SmolLM2's tokenizer, from its GGUF

    save_smollm2_tokenizer(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/moe.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="granite-1b-a400m")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--batch", type=int, nargs="+", default=[8])
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests of each batch run (default: the largest batch, one "
                             "wave: transformers' batched MoE generate is slow)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--peer", choices=["transformers", "none"], default="transformers")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none",
                        help="sluice's linears (the peer stays float32)")
    args = parser.parse_args()
    model = make_checkpoint(args.shape, args.dir)
    print(f"{args.shape}: {model}", flush=True)
    common = ["--model", str(model), "--input-len", str(args.input_len), "--output-len",
              str(args.output_len), "--peer", args.peer, "--no-flops",
              "--quantization", args.quantization]
    bench = argparse.ArgumentParser()
    offline.add_arguments(bench)
    status = offline.run(bench.parse_args(common + ["--single-stream"]))
    requests = args.num_requests or max(args.batch)
    return status or offline.run(bench.parse_args(
        common + ["--batch", *map(str, args.batch), "--num-requests", str(requests)]))


if __name__ == "__main__":
    sys.exit(main())
