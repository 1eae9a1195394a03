"""What a decode step of R one-query rows costs in the decode graph (`--quantization
gguf`): R = 1 is one stream's decode; R > 1 is a speculative verify (R - 1 drafted
tokens and the bonus row, over one sequence's context) or, with `--decodes`, R
sequences' decodes. Speculation pays only where the extra rows are cheap against one
(docs/engine.md, Speculative decoding).

    flock /tmp/sluice-heavy.lock python benchmarks/decode_graph_rows.py \
        [--rows 1 2 3 4 5 8] [--context 300] [--steps 40] [--enforce-eager]
        [--decodes] [--vs-dense]

Per R: the median and fastest of `--steps` timed forwards (after 3 untimed), and the
median relative to R = 1. `--enforce-eager` times the torch model on the same rows
instead (as `ModelRunner.execute` would run them). `--vs-dense` times each step both
on the GGUF graph (whatever its row limit) and on the dense weights (the dense graph
where the runner has one, else the torch model), alternated in this process: where
the GGUF graph's row limit (`TILES_GRAPH_MAX_ROWS`) comes from. Last stdout line: one
JSON document.
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
    parser.add_argument("--decodes", action="store_true",
                        help="R sequences' decodes (each its own blocks), not one verify")
    parser.add_argument("--vs-dense", action="store_true",
                        help="each step on the GGUF graph and on the dense weights, alternated")
    args = parser.parse_args()

    llm = LLM(resolve_model(args.model), quantization="gguf", dtype=args.dtype,
              enforce_eager=args.enforce_eager)
    runner = llm.engine.runner
    if not args.enforce_eager and runner.decode_graph is None:
        raise SystemExit("no decode graph on this machine (native kernels unavailable)")
    paths = {"torch" if args.enforce_eager else "graph": (runner.decode_graph,
                                                          runner.wide_graph)}
    if args.vs_dense:
        if args.enforce_eager:
            raise SystemExit("--vs-dense times the graph: drop --enforce-eager")
        runner.decode_graph.max_rows = max(args.rows)
        paths = {"graph": (runner.decode_graph, None),
                 "dense graph" if runner.wide_graph else "torch": (runner.wide_graph, None)}
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in paths}
    for rows in args.rows:
        chunks = step(rows, args.context, runner.block_size, args.decodes)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for i in range(3 + args.steps):
            for name, (first, wide) in paths.items():
                runner.decode_graph, runner.wide_graph = first, wide
                start = time.perf_counter()
                runner.execute(chunks)
                if i >= 3:
                    times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            results[name][rows] = {"median_ms": statistics.median(t) * 1e3,
                                   "min_ms": min(t) * 1e3}
    names = list(paths)
    print(f"{'rows':>4} " + " ".join(f"{n + ' median ms':>22} {'min ms':>8} {'x 1 row':>8}"
                                     for n in names)
          + (f" {'graph / ' + names[1]:>20}" if len(names) > 1 else ""))
    for rows in args.rows:
        cells = []
        for name in names:
            r, one = results[name][rows], results[name].get(1, {}).get("median_ms")
            rel = f"{r['median_ms'] / one:8.2f}" if one else f"{'':>8}"
            cells.append(f"{r['median_ms']:22.2f} {r['min_ms']:8.2f} {rel}")
        ratio = (f" {results[names[0]][rows]['median_ms'] / results[names[1]][rows]['median_ms']:20.2f}"
                 if len(names) > 1 else "")
        print(f"{rows:>4} " + " ".join(cells) + ratio)
    doc: dict[str, Any] = {"benchmark": "decode_graph_rows", "cpu": cpu_info(),
                           "context": args.context, "decodes": args.decodes,
                           "paths": {name: {str(k): v for k, v in r.items()}
                                     for name, r in results.items()}}
    print(json.dumps(doc))


def step(rows: int, context: int, block_size: int, decodes: bool) -> list[SeqChunk]:
    """R sequences' decodes at `context` (blocks of their own), or one sequence's verify of
    R rows at positions context .. context + R - 1."""
    blocks = -(-(context + (1 if decodes else rows)) // block_size)
    if decodes:
        return [SeqChunk([100 + i], context, list(range(i * blocks, (i + 1) * blocks)), True)
                for i in range(rows)]
    return [SeqChunk([100 + j for j in range(rows)], context, list(range(blocks)), True,
                     num_logits=rows)]


if __name__ == "__main__":
    main()
