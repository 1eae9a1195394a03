"""Time `ModelRunner.execute` on the default model against torch's own matmul rate.

Scenarios: one sequence decoding (single stream), 32 and 64 sequences decoding at
context ~200, and one 2048-token prefill step. For each, the model's FLOP rate
(2 x matmul params x tokens, plus attention) is compared with the GFLOP/s that
`torch.nn.functional.linear` reaches on the model's own weight shapes for the same
number of tokens, measured in the same run (so a busy machine slows both).

    flock /tmp/sluice-heavy.lock python benchmarks/model_forward.py [--model M] [--quick]

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk
from sluice.engine.models.llama import LlamaConfig


@dataclass
class Result:
    scenario: str
    tokens_per_step: int
    ms_per_step: float
    tokens_per_s: float
    model_gflops: float
    matmul_gflops: float
    ratio: float


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]  # median


def matmul_shapes(cfg: LlamaConfig) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matmul a token goes through, lm_head excluded."""
    h = cfg.hidden_size
    return [(h, cfg.q_size + 2 * cfg.kv_size, cfg.num_layers), (cfg.q_size, h, cfg.num_layers),
            (h, 2 * cfg.intermediate_size, cfg.num_layers), (cfg.intermediate_size, h, cfg.num_layers)]


def matmul_rate(cfg: LlamaConfig, tokens: int, logits: int, repeats: int) -> float:
    """GFLOP/s of F.linear on the model's shapes (one layer's worth, each layer alike)."""
    weights = [torch.randn(o, i) for i, o, _ in matmul_shapes(cfg)]
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    xs = [torch.randn(tokens, w.shape[1]) for w in weights]
    xh = torch.randn(logits, cfg.hidden_size)

    def run() -> None:
        for x, w in zip(xs, weights, strict=True):
            F.linear(x, w)
        F.linear(xh, head)

    seconds = best_time(run, repeats)
    flops = sum(2 * tokens * w.numel() for w in weights) + 2 * logits * head.numel()
    return flops / seconds / 1e9


def model_flops(cfg: LlamaConfig, tokens: int, logits: int, attended: int) -> float:
    """Matmul FLOPs of a step, plus attention (QK^T and PV over `attended` query-key pairs)."""
    per_token = sum(2 * i * o * n for i, o, n in matmul_shapes(cfg))
    attention = 4 * attended * cfg.head_dim * cfg.num_heads * cfg.num_layers
    return per_token * tokens + 2 * logits * cfg.vocab_size * cfg.hidden_size + attention


def decode_scenario(runner: ModelRunner, batch: int,
                    context: int) -> tuple[Callable[[], object], int, int, int]:
    """`batch` sequences with `context` tokens cached, each decoding one token per step.

    The cached K/V are left as the pool's zeros: their values do not change the work done.
    """
    bs = runner.block_size
    per_seq = (context + 1 + bs - 1) // bs
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    chunks = [SeqChunk([2], context, table, True) for table in tables]
    return (lambda: runner.execute(chunks)), batch, batch, batch * (context + 1)


def prefill_scenario(runner: ModelRunner, length: int) -> tuple[Callable[[], object], int, int, int]:
    bs = runner.block_size
    table = list(range((length + bs - 1) // bs))
    chunk = SeqChunk(list(range(100, 100 + length)), 0, table, True)
    return (lambda: runner.execute([chunk])), length, 1, length * (length + 1) // 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M GGUF)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    torch.manual_seed(0)
    runner = ModelRunner(EngineConfig.from_options(args.model, num_kv_blocks=1024))
    cfg = runner.model_config
    repeats = 5 if args.quick else 11
    scenarios = {
        "decode x1 @200": decode_scenario(runner, 1, 200),
        "decode x32 @200": decode_scenario(runner, 32, 200),
        "decode x64 @200": decode_scenario(runner, 64, 200),
        "prefill 2048": prefill_scenario(runner, 2048),
    }
    results = []
    for name, (step, tokens, logits, attended) in scenarios.items():
        n = 3 if tokens >= 2048 else repeats
        seconds = best_time(step, n)
        peer = matmul_rate(cfg, tokens, logits, n)
        rate = model_flops(cfg, tokens, logits, attended) / seconds / 1e9
        results.append(Result(name, tokens, seconds * 1e3, tokens / seconds, rate, peer, rate / peer))
    print(f"{'scenario':<18}{'tok/step':>9}{'ms/step':>10}{'tok/s':>10}"
          f"{'model GF/s':>12}{'matmul GF/s':>13}{'ratio':>7}")
    for r in results:
        print(f"{r.scenario:<18}{r.tokens_per_step:>9}{r.ms_per_step:>10.1f}{r.tokens_per_s:>10.1f}"
              f"{r.model_gflops:>12.1f}{r.matmul_gflops:>13.1f}{r.ratio:>7.2f}")
    print(json.dumps({"model": runner.model_name, "device": str(runner.device),
                      "dtype": str(runner.dtype), "threads": torch.get_num_threads(),
                      "results": [asdict(r) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
