"""What a decode step of R one-query rows costs in the decode graph (`--quantization
gguf`): R = 1 is one stream's decode; R > 1 is a speculative verify (R - 1 drafted
tokens and the bonus row, over one sequence's context) or R decodes. Speculation pays
only where the extra rows are cheap against one (docs/engine.md, Speculative decoding).

    flock /tmp/sluice-heavy.lock python benchmarks/decode_graph_rows.py \
        [--rows 1 2 3 4 5 8] [--context 300] [--steps 40] [--enforce-eager]

Per R: the median and fastest of `--steps` timed forwards (after 3 untimed), and the
median relative to R = 1. `--enforce-eager` times the torch model on the same rows
instead (as `ModelRunner.execute` would run them). Last stdout line: one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from serve_vs_vllm import cpu_info

from sluice.engine.llm import LLM
from sluice.engine.model_runner import SeqChunk
from sluice.engine.tokenizer import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    parser.add_argument("--context", type=int, default=300,
                        help="tokens of context before the rows (default 300)")
    parser.add_argument("--steps", type=int, default=40, help="timed forwards per R")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the torch model instead of the graph")
    args = parser.parse_args()

    llm = LLM(resolve_model(args.model), quantization="gguf", dtype=args.dtype,
              enforce_eager=args.enforce_eager)
    runner = llm.engine.runner
    if not args.enforce_eager and runner.decode_graph is None:
        raise SystemExit("no decode graph on this machine (native kernels unavailable)")
    bs = runner.block_size
    end = args.context + max(args.rows)
    table = list(range(-(-end // bs)))
    results: dict[int, dict[str, float]] = {}
    for rows in args.rows:
        # one sequence's verify: rows at positions context .. context + rows - 1
        chunk = SeqChunk([100 + j for j in range(rows)], args.context, table, True,
                         num_logits=rows)
        for _ in range(3):
            runner.execute([chunk])
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.execute([chunk])
            times.append(time.perf_counter() - start)
        results[rows] = {"median_ms": statistics.median(times) * 1e3,
                         "min_ms": min(times) * 1e3}
    one = results.get(1, {}).get("median_ms")
    print(f"{'rows':>4} {'median ms':>10} {'min ms':>8} {'x 1 row':>8}")
    for rows, r in results.items():
        rel = f"{r['median_ms'] / one:8.2f}" if one else f"{'':>8}"
        print(f"{rows:>4} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {rel}")
    doc: dict[str, Any] = {"benchmark": "decode_graph_rows", "cpu": cpu_info(),
                           "path": "torch" if args.enforce_eager else "graph",
                           "context": args.context,
                           "rows": {str(k): v for k, v in results.items()}}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
