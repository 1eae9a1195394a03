"""`sluice bench serve` (serving benchmark over HTTP) and `sluice bench offline` (engine).

`offline` belongs to the engine and may import torch, so its module
(`sluice.bench.offline`, exposing `add_arguments(parser)` and `run(args) -> int`) is
imported only when `sluice bench offline` actually runs: its arguments are parsed by
a parser built at that moment. `serve` imports nothing heavier than httpx and numpy.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import Any

from sluice import env
from sluice.protocol.errors import SluiceError


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: serve (HTTP), offline (engine)")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    serve = sub.add_parser(
        "serve",
        help="serving benchmark against OpenAI-compatible endpoints",
        description="Stream a seeded workload to OpenAI-compatible endpoints and report "
        "TTFT, TPOT, ITL, E2E, throughput and goodput. The last stdout line is one JSON document.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(func=_run_serve)
    # every token after `offline` is handed to the offline module's own parser; a
    # prefix char no flag uses keeps this parser from claiming `--model` and `-h`
    offline = sub.add_parser(
        "offline",
        help="offline engine benchmark (sluice.bench.offline)",
        add_help=False,
        prefix_chars="\x00",
    )
    offline.add_argument("offline_args", nargs=argparse.REMAINDER)
    offline.set_defaults(func=_run_offline)
    bench.set_defaults(func=lambda _a: (bench.print_help(), 2)[1])


def _run_serve(args: argparse.Namespace) -> int:
    from sluice.bench.serve import run

    return run(args)


def _run_offline(args: argparse.Namespace) -> int:
    try:
        offline = importlib.import_module("sluice.bench.offline")
    except ModuleNotFoundError as exc:
        if exc.name != "sluice.bench.offline":
            raise
        print("sluice bench offline: not available yet (sluice.bench.offline is not installed)", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="sluice bench offline")
    offline.add_arguments(parser)
    options = parser.parse_args(args.offline_args)
    try:
        return int(offline.run(options) or 0)
    except SluiceError as exc:  # a model that is not there, a bad --speculative-config, ...
        print(f"sluice bench offline: error: {exc.message}", file=sys.stderr)
        return 2


def _rate(text: str) -> float:
    try:
        value = float(text)  # accepts "inf"
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0 or inf, got {text!r}")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from sluice.bench.workloads import LENGTH_DISTS, WORKLOADS

    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions (token-id prompts), /v1/chat/completions (text), or a pooling model's /v1/embeddings or /classify (the prompt as input; not streamed: TTFT = E2E) (default %(default)s)")
    g.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=env.get("API_KEY"), help="sent as a Bearer token (default $SLUICE_API_KEY)")
    g.add_argument("--tokenizer", default=None, help="local tokenizer.json (or a directory with one) or .gguf; default: the server's POST /tokenize")
    g.add_argument("--compare", nargs="+", metavar="URL", help="also run the same workload against these base URLs, one after another (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true (vLLM extension) for exact output lengths")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: not sent)")
    g.add_argument("--session-header", action="store_true", help="send x-session-id (multi-turn session / shared-prefix group) for affinity")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=sorted(WORKLOADS), default="random", help="what the prompts are (default %(default)s)")
    w.add_argument("--seed", type=int, default=0, help="workload and arrival RNG (default %(default)s)")
    w.add_argument("--num-prompts", type=int, default=None, help="requests to send (default 100; all rows for trace/sharegpt)")
    w.add_argument("--input-len", type=int, default=None, help="prompt tokens (random, multi-turn: per turn, shared-prefix: question) (default 128)")
    w.add_argument("--output-len", type=int, default=None, help="max_tokens (default 128; sharegpt: the reply's length)")
    w.add_argument("--random-range-ratio", dest="range_ratio", type=float, default=None, help="length spread: uniform in [L(1-r), L(1+r)], normal sd rL, lognormal sigma r (default 0)")
    w.add_argument("--length-dist", choices=sorted(LENGTH_DISTS), default=None, help="length distribution (default uniform)")
    w.add_argument("--num-groups", type=int, default=None, help="shared-prefix: number of system prompts (default 4)")
    w.add_argument("--system-prompt-len", type=int, default=None, help="shared-prefix / multi-turn: system prompt tokens (default 256 / 0)")
    w.add_argument("--num-turns", type=int, default=None, help="multi-turn: turns per session (default 4)")
    w.add_argument("--num-sessions", type=int, default=None, help="multi-turn: sessions (default 8)")
    w.add_argument("--trace", dest="trace_path", default=None, help="trace: Mooncake JSONL file (default: none; --workload trace needs it)")
    w.add_argument("--token-scale", type=float, default=None, help="trace: scale input tokens (0.01: a 512-token block becomes 5) (default 1)")
    w.add_argument("--output-token-scale", type=float, default=None, help="trace: scale output tokens (default 1)")
    w.add_argument("--time-scale", type=float, default=None, help="trace: multiply timestamps (2: replay at half the rate) (default 1)")
    w.add_argument("--dataset-path", default=None, help="sharegpt: ShareGPT JSON file (default: none; --workload sharegpt needs it)")

    ld = p.add_argument_group("load")
    ld.add_argument("--request-rate", type=_rate, default=None, help="requests/s, Poisson arrivals (default inf: all at once)")
    ld.add_argument("--burstiness", type=_rate, default=None, help="gamma shape of inter-arrival gaps (default 1: Poisson)")
    ld.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: no cap)")
    ld.add_argument("--duration", type=float, default=None, help="seconds: start no request after this (default: no limit)")
    ld.add_argument("--warmup", type=int, default=2, help="random warm-up requests before the run, not counted (default %(default)s)")

    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=2s (bare numbers: ms) (default: none, no goodput)")
    o.add_argument("--json", default=None, metavar="FILE", help="write everything (with per-request records) here (default: not written)")
    o.add_argument("--plot", default=None, metavar="PNG", help="latency CDFs and throughput over time (default: not drawn)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
