"""A decode step of B sequences, the decode graph against the torch model: both runners
in one process, their steps alternating, so a noisy host slows both alike.

    flock /tmp/sluice-heavy.lock python benchmarks/decode_step.py \
        [--rows 1 8 32 64] [--context 200] [--steps 30] [--dtype float32|bfloat16]

Per B: B sequences of `--context` prompt tokens are prefilled in each runner, then
`--steps` decode steps of all B are timed in each, alternating; the medians and their
ratio. Where the runner has no graph for the dtype (float32: the native kernels not
built; bfloat16: neither AMX nor AVX512-BF16) the script says so. Last stdout line: one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from serve_vs_vllm import cpu_info

from sluice.engine.config import EngineConfig
from sluice.engine.model_runner import ModelRunner, SeqChunk

PREFILL_SEQS = 8  # sequences a prefill step takes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=200, help="prompt tokens a sequence")
    parser.add_argument("--steps", type=int, default=30, help="timed decode steps per B")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights, activations and KV (bfloat16: the graph on AMX tiles "
                        "or AVX512-BF16)")
    args = parser.parse_args()

    blocks_per_seq = -(-(args.context + args.steps) // 16)
    options = {"num_kv_blocks": max(args.rows) * blocks_per_seq + 1, "dtype": args.dtype,
               "block_size": 16}
    runners = {name: ModelRunner(EngineConfig.from_options(None, enforce_eager=eager, **options))
               for name, eager in (("torch", True), ("graph", False))}
    if runners["graph"].decode_graph is None:
        raise SystemExit(f"no {args.dtype} decode graph here (float32: the native panels not "
                         "built; bfloat16: neither AMX nor AVX512-BF16)")
    results = []
    for rows in args.rows:
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(rows)]
        for runner in runners.values():
            for first in range(0, rows, PREFILL_SEQS):
                runner.execute([SeqChunk([10 + i % 50] * args.context, 0, tables[i], True)
                                for i in range(first, min(rows, first + PREFILL_SEQS))])
        times: dict[str, list[float]] = {name: [] for name in runners}
        for step in range(args.steps):
            for name, runner in runners.items():
                chunks = [SeqChunk([7], args.context + step, tables[i], True) for i in range(rows)]
                start = time.perf_counter()
                runner.execute(chunks)
                times[name].append(time.perf_counter() - start)
        torch_ms, graph_ms = (statistics.median(times[n]) * 1e3 for n in ("torch", "graph"))
        results.append({"rows": rows, "torch_ms": torch_ms, "graph_ms": graph_ms,
                        "ratio": torch_ms / graph_ms})
        print(f"rows {rows:4d}: torch model {torch_ms:7.1f} ms   graph {graph_ms:7.1f} ms   "
              f"{torch_ms / graph_ms:.2f}x", flush=True)
    print(json.dumps({"benchmark": "decode_step", "cpu": cpu_info(), "dtype": args.dtype,
                      "context": args.context,
                      "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
