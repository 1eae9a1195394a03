"""`sluice bench offline`: the engine's throughput against transformers, in one run.

Workloads (seeded random token prompts, so every engine sees the same ids):

- `random`  (default): N requests, `--input-len` prompt tokens, `--output-len` output
  tokens, ignore_eos, run by sluice with `max_num_seqs` = each `--batch` value, and by
  transformers' batched greedy `generate` in batches of that size (`--peer transformers`).
- `prefix`: N requests sharing a `--prefix-len` token prefix with distinct
  `--suffix-len` suffixes, run by sluice with the prefix cache on and off.
- `--single-stream`: one request, reporting its tokens/s for sluice (and the peer), and
  sluice's decode alone after the first token (`single_stream_decode_tok_s`: what
  llama-bench's tg counts, no prompt).

Every engine gets a warm-up first. Besides wall time and output tokens/s, the sluice
runs report the model's FLOP rate (linear-layer plus attention FLOPs over the time
spent in the forward pass) against the FLOP rate torch's own matmul reaches on the
same linear shapes and row counts, timed in the same process. Progress goes to stderr;
stdout gets a table and, last, one JSON document.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sluice.engine.config import QUANTIZATIONS
from sluice.protocol.errors import InvalidRequestError

SPEEDUP_TARGET = 1.5


@dataclass
class Result:
    engine: str
    label: str
    requests: int
    output_tokens: int
    wall_s: float
    forward_s: float | None = None
    model_gflops: float | None = None  # achieved in the forward pass
    matmul_gflops: float | None = None  # torch matmul on the same shapes, each shape alone
    streamed_matmul_gflops: float | None = None  # ... over one weight set per layer
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def _count(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = _count(1)
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2 GGUF)")
    parser.add_argument("--workload", choices=["random", "prefix"], default="random",
                        help="random prompts, or one shared prefix and each its own "
                             "suffix (default %(default)s)")
    parser.add_argument("--num-requests", type=positive, default=None,
                        help="random, prefix: requests (default 64)")
    parser.add_argument("--input-len", type=positive, default=None,
                        help="random, --single-stream: prompt tokens (default 128)")
    parser.add_argument("--output-len", type=positive, default=None,
                        help="output tokens per request (default 128; 32 for prefix)")
    parser.add_argument("--batch", type=positive, nargs="+", default=None,
                        help="random: each concurrency to run, sluice max_num_seqs and the "
                             "peer's batch size; prefix: one (default 32 64; prefix: 64)")
    parser.add_argument("--prefix-len", type=_count(0), default=None,
                        help="prefix: shared prompt tokens (default 1024)")
    parser.add_argument("--suffix-len", type=positive, default=None,
                        help="prefix: each request's own prompt tokens (default 32)")
    parser.add_argument("--single-stream", action="store_true",
                        help="one random request: its tokens/s, and its decode alone after "
                             "the first token")
    parser.add_argument("--peer", choices=["transformers", "none"], default=None,
                        help="random, --single-stream: the engine to compare with (default "
                             "transformers; prefix runs sluice with its cache on and off)")
    parser.add_argument("--max-num-batched-tokens", type=positive, default=2048,
                        help="sluice: tokens per engine step (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random prompts and torch's RNG (default %(default)s)")
    parser.add_argument("--quantization", choices=list(QUANTIZATIONS), default="none",
                        help="sluice's linears: dense (none), on the GGUF file's blocks "
                             "for decode rows (gguf) or on int8 weights (int8); the peer "
                             "is unchanged (default %(default)s)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="sluice: every step through the torch model (no decode graph)")
    parser.add_argument("--no-flops", action="store_true", help="skip the matmul reference")
    parser.add_argument("--speculative-config", default=None,
                        help="sluice: speculative decoding, vLLM's JSON (benchmarks/"
                             "spec_decode.py compares it with plain decoding) (default: off)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and activations, for sluice and the peer alike "
                             "(default float32, not the engine's auto)")


# the options each mode reads, with their defaults; one given to a mode that does not
# read it is an error (it would be ignored)
MODE_OPTIONS: dict[str, dict[str, Any]] = {
    "random": {"num_requests": 64, "input_len": 128, "batch": [32, 64], "peer": "transformers"},
    "prefix": {"num_requests": 64, "prefix_len": 1024, "suffix_len": 32, "batch": [64]},
    "single-stream": {"input_len": 128, "peer": "transformers"},
}


def resolve_options(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the mode's defaults filled in; raises InvalidRequestError naming the
    flags given that the mode (`--workload`, or `--single-stream`) does not read."""
    if args.single_stream and args.workload != "random":
        raise InvalidRequestError("--single-stream runs one random prompt: it does not use "
                                  f"--workload {args.workload}", param="workload")
    mode = "single-stream" if args.single_stream else args.workload
    reads = MODE_OPTIONS[mode]
    unused = [dest for options in MODE_OPTIONS.values() for dest in options
              if dest not in reads and getattr(args, dest) is not None]
    if unused:
        flags = ", ".join(dict.fromkeys("--" + d.replace("_", "-") for d in unused))
        where = "--single-stream" if args.single_stream else f"--workload {mode}"
        raise InvalidRequestError(f"{where} does not use {flags}", param=unused[0])
    if mode == "prefix" and args.batch is not None and len(args.batch) > 1:
        raise InvalidRequestError("--workload prefix runs at one --batch", param="batch")
    filled = {dest: default for dest, default in reads.items() if getattr(args, dest) is None}
    return argparse.Namespace(**(vars(args) | filled))


def progress(msg: str) -> None:
    print(f"[bench offline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- workloads ----------------------------------------------------------------------
def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int,
                   seed: int) -> list[list[int]]:
    shared = random_prompts(1, prefix_len, vocab, seed)[0]
    return [shared + s for s in random_prompts(n, suffix_len, vocab, seed + 1)]


# -- sluice -------------------------------------------------------------------------
class StepRecorder:
    """Wraps the runner's `execute` to time the forward and count rows per step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.inner = runner.execute
        self.steps: list[tuple[int, int, int]] = []  # (tokens, logit rows, attended ctx sum)
        self.forward_s = 0.0
        runner.execute = self

    def __call__(self, chunks: list[Any]) -> Any:
        t0 = time.perf_counter()
        out = self.inner(chunks)
        self.forward_s += time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in chunks)
        ctx = sum(len(c.token_ids) * (c.start_pos + (len(c.token_ids) + 1) / 2) for c in chunks)
        self.steps.append((tokens, sum(1 for c in chunks if c.need_logits), int(ctx)))
        return out

    def reset(self) -> None:
        self.steps, self.forward_s = [], 0.0


def run_sluice(llm: Any, prompts: list[list[int]], output_len: int, label: str) -> Result:
    from sluice.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{label}-{i}", prompt, params)
    done, t0, last, first = 0, time.perf_counter(), 0.0, None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if first is None and outputs:
            first = time.perf_counter() - t0  # one stream: its prefill and first token
        done += sum(1 for o in outputs if o.finished)
        if time.perf_counter() - last > 5:
            last = time.perf_counter()
            progress(f"sluice {label}: {done}/{len(prompts)} done, {last - t0:.1f}s")
    wall = time.perf_counter() - t0
    stats = engine.stats()
    return Result("sluice", label, len(prompts), len(prompts) * output_len, wall,
                  extra={"prefix_cache_hits": stats.prefix_cache_hits,
                         "num_preemptions": stats.num_preemptions, "first_output_s": first})


def configure(llm: Any, batch: int, caching: bool = True) -> None:
    """Re-plan the loaded engine for a run: max_num_seqs = batch, prefix cache on/off."""
    import dataclasses

    from sluice.engine.scheduler import Scheduler

    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.enable_prefix_caching = caching
    engine.block_manager.reset_prefix_cache()
    config = dataclasses.replace(engine.config.scheduler, max_num_seqs=batch)
    engine.scheduler = Scheduler(config, engine.block_manager)


def timed_sluice(llm: Any, recorder: StepRecorder, prompts: list[list[int]], output_len: int,
                 label: str, flops: FlopModel | None) -> Result:
    llm.engine.block_manager.reset_prefix_cache()
    llm.engine.block_manager.prefix_hits = 0
    recorder.reset()
    result = run_sluice(llm, prompts, output_len, label)
    result.forward_s = recorder.forward_s
    if flops is not None:
        result.model_gflops, result.matmul_gflops, result.streamed_matmul_gflops = \
            flops.rates(recorder)
    return result


# -- FLOP accounting ------------------------------------------------------------------
class FlopModel:
    """Linear + attention FLOPs of the model, and torch matmul timing on its shapes.

    Two references. Per shape: each shape timed alone, so its one weight matrix sits in
    cache, an upper bound no forward reaches when few rows make a step memory-bound.
    Streamed (steps of at most STREAMED_MAX_ROWS rows): a whole step's linears over one
    distinct weight set per layer, as the model reads them; larger steps are
    compute-bound and keep the per-shape time.
    """

    STREAMED_MAX_ROWS = 128

    def __init__(self, cfg: Any, dtype: Any) -> None:
        self.cfg = cfg
        self.dtype = dtype
        h = cfg.hidden_size
        self.layer_shapes = [(h, cfg.q_size + 2 * cfg.kv_size), (cfg.q_size, h),
                             (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]
        self.head_shape = (h, cfg.vocab_size)
        self._cache: dict[tuple[int, int, int], float] = {}
        self._streamed: dict[tuple[int, int], float] = {}
        self._layer_weights: list[list[Any]] = []
        self._head_weight: Any = None

    def linear_flops(self, tokens: int, rows: int) -> float:
        per_layer = sum(2 * i * o for i, o in self.layer_shapes)
        return tokens * per_layer * self.cfg.num_layers + rows * 2 * self.head_shape[0] * \
            self.head_shape[1]

    def attention_flops(self, ctx: int) -> float:
        return 4.0 * self.cfg.num_layers * self.cfg.q_size * ctx

    @functools.cached_property
    def _linear_forms(self) -> list[Any]:
        """F.linear, and oneDNN's linear where the engine would use it."""
        import torch

        from sluice.engine.native import cpu_linear

        onednn = cpu_linear("auto", torch.device("cpu"), self.dtype)
        forms: list[Any] = [torch.nn.functional.linear]
        if onednn is not None:
            forms.append(lambda x, w: onednn(x, w, None))
        return forms

    def _matmul_s(self, m: int, k: int, n: int) -> float:
        import torch

        key = (m, k, n)
        if key not in self._cache:
            x, w = torch.randn(m, k, dtype=self.dtype), torch.randn(n, k, dtype=self.dtype)
            w_in_out = w.t().contiguous()
            reps = max(2, min(20, int(1e9 / max(1, 2 * m * k * n))))
            best = float("inf")
            # best of three, of every way torch multiplies (MKL with either weight layout,
            # oneDNN): the machine is shared, take the least noisy run of the fastest form
            forms: list[Any] = [functools.partial(f, x, w) for f in self._linear_forms]
            forms.append(lambda: x @ w_in_out)
            for matmul in forms:
                matmul()
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        matmul()
                    best = min(best, (time.perf_counter() - t0) / reps)
            self._cache[key] = best
        return self._cache[key]

    def reference_s(self, tokens: int, rows: int) -> float:
        """Seconds torch's matmul needs for one step's linear layers (per shape)."""
        layers = sum(self._matmul_s(tokens, i, o) for i, o in self.layer_shapes)
        head = self._matmul_s(rows, *self.head_shape) if rows else 0.0
        return layers * self.cfg.num_layers + head

    def streamed_reference_s(self, tokens: int, rows: int) -> float:
        """The same step's linears over one weight set per layer (small steps only)."""
        if tokens > self.STREAMED_MAX_ROWS:
            return self.reference_s(tokens, rows)
        import torch

        key = (tokens, rows)
        if key not in self._streamed:
            if not self._layer_weights:  # the model's size in distinct matrices, once
                self._layer_weights = [[torch.randn(o, i, dtype=self.dtype)
                                        for i, o in self.layer_shapes]
                                       for _ in range(self.cfg.num_layers)]
                self._head_weight = torch.randn(self.head_shape[1], self.head_shape[0],
                                                dtype=self.dtype)
            xs = {i: torch.randn(tokens, i, dtype=self.dtype) for i, _ in self.layer_shapes}
            head_x = torch.randn(rows, self.head_shape[0], dtype=self.dtype)
            best = float("inf")
            for linear in self._linear_forms:
                for _ in range(3):
                    t0 = time.perf_counter()
                    for weights in self._layer_weights:
                        for w in weights:
                            linear(xs[w.shape[1]], w)
                    if rows:
                        linear(head_x, self._head_weight)
                    best = min(best, time.perf_counter() - t0)
            self._streamed[key] = best
        return self._streamed[key]

    def rates(self, rec: StepRecorder) -> tuple[float, float, float]:
        """(model GFLOP/s in the forward, torch matmul GFLOP/s on the same linears: per
        shape, and streamed)."""
        counts = Counter((_bucket(t), _bucket(r) if r else 0) for t, r, _ in rec.steps)
        ref = sum(n * self.reference_s(t, r) for (t, r), n in counts.items())
        streamed = sum(n * self.streamed_reference_s(t, r) for (t, r), n in counts.items())
        linear = sum(self.linear_flops(t, r) for t, r, _ in rec.steps)
        attn = sum(self.attention_flops(c) for _, _, c in rec.steps)
        model = (linear + attn) / rec.forward_s / 1e9 if rec.forward_s else 0.0
        bucketed = sum(n * self.linear_flops(t, r) for (t, r), n in counts.items())
        return (model, bucketed / ref / 1e9 if ref else 0.0,
                bucketed / streamed / 1e9 if streamed else 0.0)


def _bucket(n: int) -> int:
    """Round a row count up to a few distinct sizes so matmul timing stays cheap."""
    if n <= 8:
        return n
    step = 16 if n <= 128 else 128
    return (n + step - 1) // step * step


# -- transformers peer ---------------------------------------------------------------
def load_peer(model: str | None, dtype: str, device: Any) -> Any:
    """transformers' model of the same file, on sluice's device (CPU or GPU)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from sluice.engine.tokenizer import resolve_model

    path = resolve_model(model)
    kw: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if path.endswith(".gguf"):
        kw["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    peer = AutoModelForCausalLM.from_pretrained(path, **kw).to(device)
    peer.generation_config.eos_token_id = None  # ignore_eos, like the sluice runs
    return peer.eval()


def run_peer(peer: Any, prompts: list[list[int]], output_len: int, batch: int,
             label: str) -> Result:
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), batch):
            # equal lengths: no padding
            ids = torch.tensor(prompts[start:start + batch], device=peer.device)
            out = peer.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len,
                                pad_token_id=0)
            out.cpu()  # a GPU's generate may return before its last step has run
            progress(f"transformers {label}: {min(start + batch, len(prompts))}/{len(prompts)}"
                     f" done, {time.perf_counter() - t0:.1f}s")
    wall = time.perf_counter() - t0
    return Result("transformers", label, len(prompts), len(prompts) * output_len, wall)


# -- the modes -------------------------------------------------------------------------
def bench_random(args: argparse.Namespace, llm: Any, rec: StepRecorder, peer: Any,
                 flops: FlopModel | None, output_len: int
                 ) -> tuple[list[Result], dict[str, Any]]:
    prompts = random_prompts(args.num_requests, args.input_len, llm.engine.runner.vocab_size,
                             args.seed)
    results, summary = [], {}
    for batch in args.batch:
        configure(llm, batch)
        run_sluice(llm, prompts[:2], 4, f"warmup-b{batch}")
        progress(f"sluice batch={batch}: {len(prompts)} requests")
        ours = timed_sluice(llm, rec, prompts, output_len, f"batch={batch}", flops)
        results.append(ours)
        if peer is not None:
            run_peer(peer, prompts[:2], 4, 2, "warmup")
            theirs = run_peer(peer, prompts, output_len, batch, f"batch={batch}")
            results.append(theirs)
            summary[f"speedup_vs_transformers_batch{batch}"] = round(ours.tok_s / theirs.tok_s, 3)
    return results, summary


def bench_single(args: argparse.Namespace, llm: Any, rec: StepRecorder, peer: Any,
                 flops: FlopModel | None, output_len: int
                 ) -> tuple[list[Result], dict[str, Any]]:
    prompt = random_prompts(1, args.input_len, llm.engine.runner.vocab_size, args.seed)
    configure(llm, 1)
    run_sluice(llm, prompt, 4, "warmup")
    ours = timed_sluice(llm, rec, prompt, output_len, "single-stream", flops)
    # decode alone (after the first token), as llama-bench's tg counts: no prompt
    decode_s = ours.wall_s - ours.extra["first_output_s"]
    results, summary = [ours], {"single_stream_tok_s": round(ours.tok_s, 2),
                                "single_stream_decode_tok_s":
                                    round((output_len - 1) / decode_s, 2) if decode_s > 0 else None}
    if peer is not None:
        run_peer(peer, prompt, 4, 1, "warmup")
        theirs = run_peer(peer, prompt, output_len, 1, "single-stream")
        results.append(theirs)
        summary["speedup_vs_transformers_single"] = round(ours.tok_s / theirs.tok_s, 3)
    return results, summary


def bench_prefix(args: argparse.Namespace, llm: Any, rec: StepRecorder,
                 flops: FlopModel | None, output_len: int
                 ) -> tuple[list[Result], dict[str, Any]]:
    vocab = llm.engine.runner.vocab_size
    prompts = prefix_prompts(args.num_requests, args.prefix_len, args.suffix_len, vocab,
                             args.seed)
    batch = max(args.batch)
    results = []
    for caching in (True, False):
        configure(llm, batch, caching)
        run_sluice(llm, random_prompts(2, 16, vocab, args.seed + 7), 4, "warmup")
        label = f"prefix-cache {'on' if caching else 'off'}"
        progress(f"sluice {label}: {len(prompts)} requests")
        results.append(timed_sluice(llm, rec, prompts, output_len, label, flops))
    return results, {"prefix_cache_speedup": round(results[0].tok_s / results[1].tok_s, 3)}


def print_table(results: list[Result]) -> None:
    head = (f"{'engine':<13}{'run':<20}{'reqs':>5}{'out tok':>9}{'wall s':>9}{'tok/s':>9}"
            f"{'fwd GF/s':>10}{'mm GF/s':>9}{'ratio':>7}{'streamed':>10}{'ratio':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        mg = f"{r.model_gflops:.1f}" if r.model_gflops else "-"
        refs = [(f"{ref:.1f}", f"{r.model_gflops / ref:.2f}") if r.model_gflops and ref
                else ("-", "-") for ref in (r.matmul_gflops, r.streamed_matmul_gflops)]
        print(f"{r.engine:<13}{r.label:<20}{r.requests:>5}{r.output_tokens:>9}"
              f"{r.wall_s:>9.2f}{r.tok_s:>9.1f}{mg:>10}{refs[0][0]:>9}{refs[0][1]:>7}"
              f"{refs[1][0]:>10}{refs[1][1]:>7}")


def run(args: argparse.Namespace) -> int:
    import torch

    from sluice.engine.llm import LLM

    args = resolve_options(args)
    torch.manual_seed(args.seed)
    output_len = args.output_len or (32 if args.workload == "prefix" else 128)
    progress(f"loading sluice: {args.model or 'default SmolLM2 GGUF'}, torch threads "
             f"{torch.get_num_threads()}")
    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
              speculative_config=args.speculative_config, quantization=args.quantization,
              enforce_eager=args.enforce_eager)
    rec = StepRecorder(llm.engine.runner)
    device = llm.engine.runner.device
    if device.type != "cpu" and not args.no_flops:
        progress(f"on {device}: no matmul reference (it times the CPU's matmuls)")
    flops = None if args.no_flops or device.type != "cpu" else FlopModel(
        llm.engine.runner.model_config, getattr(torch, args.dtype))
    peer = None
    if args.peer == "transformers":  # random and --single-stream read it, prefix does not
        progress("loading the transformers peer")
        peer = load_peer(args.model, args.dtype, device)
    if args.single_stream:
        results, summary = bench_single(args, llm, rec, peer, flops, output_len)
    elif args.workload == "prefix":
        results, summary = bench_prefix(args, llm, rec, flops, output_len)
    else:
        results, summary = bench_random(args, llm, rec, peer, flops, output_len)
    print_table(results)
    doc = {"benchmark": "offline", "model": args.model or "default", "dtype": args.dtype,
           "quantization": args.quantization, "enforce_eager": args.enforce_eager,
           "workload": args.workload,
           "single_stream": args.single_stream,
           **({"prefix_len": args.prefix_len, "suffix_len": args.suffix_len}
              if args.workload == "prefix" and not args.single_stream else {}),
           "input_len": args.input_len if args.input_len is not None
           else args.prefix_len + args.suffix_len,
           "output_len": output_len, "num_requests": 1 if args.single_stream else args.num_requests,
           "results": [dict(asdict(r), tok_s=round(r.tok_s, 2)) for r in results], **summary}
    ratios = [r.model_gflops / r.matmul_gflops for r in results
              if r.model_gflops and r.matmul_gflops]
    if ratios:
        doc["flop_ratio_vs_matmul"] = round(min(ratios), 3)
    streamed = [r.model_gflops / r.streamed_matmul_gflops for r in results
                if r.model_gflops and r.streamed_matmul_gflops]
    if streamed:
        doc["flop_ratio_vs_streamed_matmul"] = round(min(streamed), 3)
    print(json.dumps(doc))
    return 0
