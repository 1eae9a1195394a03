"""sluice vs llama.cpp on the same GGUF file, same threads, same run (issue 19's peer).

Three comparisons, each with both sides measured in this run, one after the other:

1. Offline, one stream: llama.cpp's `llama-bench` tg128 (`-p 0 -n 128 -t T`, its own
   repetitions: generation alone, no prompt) against `sluice bench offline
   --single-stream` with an 8-token prompt and 128 output tokens, for each
   `--quantization` given (default: gguf and none): the whole request, and its decode
   alone after the first token (the same count as tg's).
   Rounds alternate the two programs (`--rounds`), so drift on a shared machine hits
   both.
2. HTTP, one stream: `llama-server -np 1` (one slot) against `sluice worker
   --quantization gguf`, the same `sluice bench serve` client as serve_vs_vllm.py
   (random 139-token prompts as token ids, 128 output tokens, ignore_eos, temperature 0).
3. Greedy agreement: a few fixed prompts through both servers' `/v1/completions`
   (temperature 0, 48 tokens, token ids in, the text out re-tokenized with the model's
   tokenizer), and through `sluice worker --quantization none` (the dequantized weights:
   the reference both quantized paths approximate); reports, per prompt and pair, the
   tokens produced before the first difference.

llama.cpp is built from the `llama-cpp-python` sdist's vendored copy (docs/bench.md):

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/vs_llamacpp.py \\
        --llama-bin /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin

Prints tables; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from serve_vs_vllm import bench, cpu_info, git_rev, server, utc_now

from sluice.control.local import free_port

AGREEMENT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here are three tips for staying healthy:\n1.",
    "Once upon a time, in a small village by the sea,",
    "The theory of relativity says that",
)


def llama_bench(args: argparse.Namespace, gguf: str) -> dict[str, Any]:
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", gguf, "-t", str(args.threads),
           "-p", "0", "-n", str(args.output_len), "-r", str(args.llama_reps), "-o", "json"]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900)
    test = json.loads(out.stdout)[0]
    return {"tok_s": test["avg_ts"], "stdev_tok_s": test["stddev_ts"],
            "build": test.get("build_commit"), "cpu_info": test.get("cpu_info")}


def sluice_single(args: argparse.Namespace, quantization: str) -> dict[str, Any]:
    """`sluice bench offline --single-stream`; `quantization` is a --quantization value,
    with `-eager` appended for --enforce-eager (e.g. gguf-eager: no decode graph)."""
    kind, _, mode = quantization.partition("-")
    cmd = [args.sluice, "bench", "offline", "--single-stream", "--peer", "none", "--no-flops",
           "--input-len", "8", "--output-len", str(args.output_len), "--dtype", args.dtype,
           "--quantization", kind, *(["--enforce-eager"] if mode == "eager" else [])]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"sluice bench offline failed ({out.returncode}):\n{out.stderr[-3000:]}")
    summary = json.loads(lines[-1])
    return {"tok_s": summary["single_stream_tok_s"],
            "decode_tok_s": summary["single_stream_decode_tok_s"]}


def offline(args: argparse.Namespace, gguf: str) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        one = {"llama.cpp": llama_bench(args, gguf)}
        for q in args.quantization:
            one[f"sluice {q}"] = sluice_single(args, q)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['tok_s']:.1f}" for k, v in one.items()),
              file=sys.stderr, flush=True)
        rounds.append(one)
    return {"rounds": rounds}


def completion_tokens(url: str, model: str, prompt_ids: list[int], tok: Any, n: int
                      ) -> list[int]:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": n,
            "temperature": 0, "ignore_eos": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=300, trust_env=False)
    resp.raise_for_status()
    return list(tok.encode(resp.json()["choices"][0]["text"], add_special_tokens=False))


def agreement_ids(tok: Any) -> list[list[int]]:
    return [list(tok.encode(p, add_special_tokens=False)) for p in AGREEMENT_PROMPTS]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def http(args: argparse.Namespace, gguf: str, logs: Path, tok: Any) -> dict[str, Any]:
    """Each server in turn: the one-stream bench, then the agreement prompts."""
    out: dict[str, Any] = {}
    prompts = agreement_ids(tok)
    port = free_port()
    llama = [str(Path(args.llama_bin) / "llama-server"), "-m", gguf, "-t", str(args.threads),
             "-np", "1", "-c", "4096", "--host", "127.0.0.1", "--port", str(port),
             *shlex.split(args.llama_server_args)]
    try:
        with server(llama, port, logs / "llama-server.log", 300) as (url, startup, _):
            out["llama.cpp"] = {"startup_s": startup, "bench": bench(args, url, 1, args.seed),
                                "tokens": [completion_tokens(url, "m", p, tok, args.agree_len)
                                           for p in prompts]}
    except RuntimeError as e:  # llama-server died at start (seen on a Sapphire Rapids VM)
        print(f"llama-server failed: {e}", file=sys.stderr, flush=True)
        out["llama.cpp"] = {"error": str(e).splitlines()[0]}
    for quantization in ("gguf", "none"):  # `none` (dequantized weights): agreement only
        port = free_port()
        worker = [args.sluice, "worker", "--host", "127.0.0.1", "--port", str(port),
                  "--dtype", args.dtype, "--quantization", quantization]
        with server(worker, port, logs / f"sluice-{quantization}.log", 300,
                    {"OMP_NUM_THREADS": str(args.threads)}) as (url, startup, _):
            model = httpx.get(url + "/v1/models", trust_env=False).json()["data"][0]["id"]
            out[f"sluice {quantization}"] = side = {
                "startup_s": startup,
                "tokens": [completion_tokens(url, model, p, tok, args.agree_len) for p in prompts]}
            if quantization == "gguf":
                side["bench"] = bench(args, url, 1, args.seed)
    pairs = (("llama.cpp", "sluice gguf"), ("llama.cpp", "sluice none"),
             ("sluice gguf", "sluice none"))
    pairs = tuple((a, b) for a, b in pairs if "tokens" in out[a])
    out["agreement"] = {
        f"{a} vs {b}": [common_prefix(x, y) for x, y in zip(out[a]["tokens"], out[b]["tokens"],
                                                           strict=True)] for a, b in pairs}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bin", required=True, help="folder with llama-bench and llama-server")
    p.add_argument("--model", default=None, help="GGUF file (default: the SmolLM2 GGUF)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--quantization", nargs="+", default=["gguf", "none"],
                   help="sluice's --quantization per offline run; NAME-eager adds "
                        "--enforce-eager (e.g. gguf-eager: the torch model, no decode graph)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="sluice's activations and dense weights")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-reps", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=139, help="HTTP prompts (tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agree-len", type=int, default=48, help="greedy tokens compared")
    p.add_argument("--llama-server-args", default="",
                   help="more llama-server options, e.g. '--no-repack' where its AMX path dies "
                        "at start (SIGILL in its AMX tile kernel on some VMs)")
    p.add_argument("--parts", nargs="+", choices=("offline", "http"), default=["offline", "http"])
    p.add_argument("--bench-timeout", type=float, default=900.0)
    p.add_argument("--sluice", default=str(Path(sys.executable).parent / "sluice"))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    from sluice.engine.tokenizer import load_tokenizer, resolve_model

    gguf = args.model or resolve_model(None)
    started = utc_now()
    cpu = cpu_info()
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores, flags {' '.join(cpu['flags'])}; "
          f"sluice {git_rev()}; {args.threads} threads; {gguf}", flush=True)
    doc: dict[str, Any] = {"benchmark": "vs_llamacpp", "cpu": cpu, "started_at": started,
                           "config": vars(args)}
    if "offline" in args.parts:
        doc["offline"] = offline(args, gguf)
        print_offline(args, doc["offline"])
    if "http" in args.parts:
        args.tokenizer = gguf  # llama-server's /tokenize is not sluice's or vLLM's
        tok = load_tokenizer(gguf)
        logs = Path(tempfile.mkdtemp(prefix="vs_llamacpp-"))
        doc["http"] = http(args, gguf, logs, tok)
        print_http(args, doc["http"], logs)
    doc["finished_at"] = utc_now()
    print(json.dumps(doc))
    return 0


def print_offline(args: argparse.Namespace, off: dict[str, Any]) -> None:
    names = list(off["rounds"][0])
    print(f"\none stream, tg{args.output_len} tok/s (sluice: 8-token prompt), per round")
    print(f"{'engine':<22}" + "".join(f"{f'round {i + 1}':>10}" for i in range(args.rounds))
          + f"  {'vs llama.cpp'}")
    rows = [(name, name, "tok_s") for name in names] + [
        (f"{name} decode", name, "decode_tok_s") for name in names if name != "llama.cpp"]
    for label, name, key in rows:
        vals = [r[name][key] for r in off["rounds"]]
        ratio = [r[name][key] / r["llama.cpp"]["tok_s"] for r in off["rounds"]]
        print(f"{label:<22}" + "".join(f"{v:>10.1f}" for v in vals)
              + "  " + " / ".join(f"{x:.2f}" for x in ratio))
    print("(sluice: the whole request, 8-token prompt included; decode: after its first "
          "token, as tg counts)")


def print_http(args: argparse.Namespace, h: dict[str, Any], logs: Path) -> None:
    print(f"\nHTTP, one stream, {args.input_len}-token prompts, {args.output_len} tokens "
          f"(logs in {logs})")
    for name in ("llama.cpp", "sluice gguf"):
        if "error" in h[name]:
            print(f"{name:<14}failed: {h[name]['error']}")
            continue
        b = h[name]["bench"]
        print(f"{name:<14}{b['output_throughput']:>8.1f} tok/s  TTFT p50 "
              f"{b['p50_ttft_ms']:.0f} ms  TPOT p50 {b['p50_tpot_ms']:.1f} ms")
    if "bench" in h["llama.cpp"]:
        ratio = h["sluice gguf"]["bench"]["output_throughput"] / h["llama.cpp"]["bench"][
            "output_throughput"]
        print(f"sluice / llama-server: {ratio:.2f}")
    print(f"greedy agreement, tokens before the first difference (of {args.agree_len}) per "
          "prompt:")
    for pair, same in h["agreement"].items():
        print(f"  {pair:<28}{same}")


if __name__ == "__main__":
    raise SystemExit(main())
