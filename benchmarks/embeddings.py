"""Embeddings through HTTP: `sluice worker`'s `POST /v1/embeddings` against transformers'
own forward of the same model, in one run, on the same seeded token ids.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/embeddings.py \\
        [--model PATH] [--dtype float32] [--num-inputs 512] [--input-len 32 256] \\
        [--batch 16] [--concurrency 4] [--peer-batch 32] [--peer-pooling last|cls|mean]

For each input length: the worker (started here, `--dtype`, its defaults otherwise) gets
`--num-inputs` inputs of that many random token ids, `--batch` inputs a request, from
`--concurrency` clients at once (after a warm-up); transformers (`AutoModel` of the
same file, the same dtype, all cores) runs the same ids in batches of `--peer-batch`
(equal lengths: no padding) and takes the last token's final hidden state, normalized
(`--peer-pooling cls` the first token's, `mean` the mean: an encoder model's pooling,
which the worker reads from the checkpoint or `--worker-arg=--pooler-config=...`).
Reports inputs/s and input tokens/s of both, their ratio, the request latency p50, and
the cosine similarity of each sluice vector to the peer's for the same ids (sluice runs
a GGUF file's linears on its quantized blocks by default, transformers on the
dequantized weights: expect ~0.99, not 1). `--vllm-url` adds a vLLM server already
serving the model for embeddings (e.g. `--runner pooling --convert embed` on a float32
copy; docs/bench.md) to the same run: the same client and ids, after sluice. Progress on
stderr; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx
import numpy as np
from serve_vs_vllm import cpu_info, wait_healthy  # benchmarks/ is on sys.path as a script

from sluice.control.local import free_port
from sluice.engine.tokenizer import resolve_model


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def inputs_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


async def run_http(url: str, model: str, inputs: list[list[int]], batch: int,
                   concurrency: int) -> tuple[float, list[float], list[np.ndarray]]:
    """Wall seconds, each request's latency, the vectors in input order."""
    requests = [list(range(i, min(i + batch, len(inputs)))) for i in range(0, len(inputs), batch)]
    vectors: list[np.ndarray] = [np.empty(0)] * len(inputs)
    latencies: list[float] = []
    queue = list(reversed(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker() -> None:
            while queue:
                which = queue.pop()
                t0 = time.perf_counter()
                r = await client.post("/v1/embeddings", json={
                    "model": model, "input": [inputs[i] for i in which]})
                r.raise_for_status()
                latencies.append(time.perf_counter() - t0)
                for i, d in zip(which, r.json()["data"], strict=True):
                    vectors[i] = np.asarray(d["embedding"], dtype=np.float32)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - t0, latencies, vectors


def first_model(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


def load_peer(path: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModel

    kw: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if path.endswith(".gguf"):
        kw["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(path)
    return AutoModel.from_pretrained(path, **kw).eval()


def run_peer(peer: Any, inputs: list[list[int]], batch: int,
             pooling: str = "last") -> tuple[float, list[np.ndarray]]:
    import torch

    out: list[np.ndarray] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(inputs), batch):
            ids = torch.tensor(inputs[start:start + batch])
            states = peer(ids).last_hidden_state.float()
            pooled = states.mean(1) if pooling == "mean" else \
                states[:, 0] if pooling == "cls" else states[:, -1]
            out += list(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-inputs", type=int, default=512)
    ap.add_argument("--input-len", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--batch", type=int, default=16, help="inputs a request")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--peer-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-pooling", choices=("last", "cls", "mean"), default="last",
                    help="the hidden state transformers' vectors take (the worker's pooling)")
    ap.add_argument("--worker-arg", action="append", default=[],
                    help="one more `sluice worker` argument (repeatable)")
    ap.add_argument("--vllm-url", default=None, help="a vLLM server to measure as well")
    args = ap.parse_args()
    path = resolve_model(args.model)
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "worker", "--model", path, "--port", str(port),
           "--dtype", args.dtype, "--log-level", "warning", *args.worker_arg]
    say(f"starting: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    rows: list[dict[str, Any]] = []
    try:
        wait_healthy(url, 300, proc, None)
        model = first_model(url)
        vllm_model = first_model(args.vllm_url) if args.vllm_url else None
        peer = load_peer(path, args.dtype)
        vocab = int(peer.config.vocab_size)
        for length in args.input_len:
            inputs = inputs_of(args.num_inputs, length, vocab, args.seed + length)
            warm = inputs_of(args.batch * args.concurrency, length, vocab, args.seed - length)
            asyncio.run(run_http(url, model, warm, args.batch, args.concurrency))
            run_peer(peer, warm[:args.peer_batch], args.peer_batch, args.peer_pooling)
            wall, latencies, ours = asyncio.run(run_http(url, model, inputs, args.batch,
                                                         args.concurrency))
            say(f"sluice, {length} tokens: {len(inputs) / wall:.1f} inputs/s")
            peer_wall, theirs = run_peer(peer, inputs, args.peer_batch, args.peer_pooling)
            say(f"transformers, {length} tokens: {len(inputs) / peer_wall:.1f} inputs/s")
            cosine = [float(a @ b) for a, b in zip(ours, theirs, strict=True)]
            row = {"input_len": length, "inputs": len(inputs),
                   "sluice_inputs_s": len(inputs) / wall,
                   "sluice_tokens_s": len(inputs) * length / wall,
                   "sluice_request_p50_ms": statistics.median(latencies) * 1000,
                   "peer_inputs_s": len(inputs) / peer_wall,
                   "ratio": peer_wall / wall,
                   "cosine_min": min(cosine), "cosine_mean": statistics.fmean(cosine)}
            if args.vllm_url and vllm_model:
                asyncio.run(run_http(args.vllm_url, vllm_model, warm, args.batch,
                                     args.concurrency))
                vwall, vlat, vllms = asyncio.run(run_http(args.vllm_url, vllm_model, inputs,
                                                          args.batch, args.concurrency))
                say(f"vLLM, {length} tokens: {len(inputs) / vwall:.1f} inputs/s")
                vcos = [float(a @ b) for a, b in zip(vllms, theirs, strict=True)]
                row.update({"vllm_inputs_s": len(inputs) / vwall,
                            "vllm_request_p50_ms": statistics.median(vlat) * 1000,
                            "sluice_over_vllm": vwall / wall,
                            "vllm_cosine_min": min(vcos)})
            rows.append(row)
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{'input tokens':>12} {'sluice in/s':>12} {'tok/s':>9} {'req p50 ms':>11} "
          f"{'transformers in/s':>18} {'ratio':>6} {'cosine min/mean':>16}")
    for r in rows:
        print(f"{r['input_len']:>12} {r['sluice_inputs_s']:>12.1f} {r['sluice_tokens_s']:>9.0f} "
              f"{r['sluice_request_p50_ms']:>11.1f} {r['peer_inputs_s']:>18.1f} "
              f"{r['ratio']:>6.2f} {r['cosine_min']:>7.4f}/{r['cosine_mean']:.4f}")
        if "vllm_inputs_s" in r:
            print(f"{'':>12} vLLM: {r['vllm_inputs_s']:.1f} inputs/s, request p50 "
                  f"{r['vllm_request_p50_ms']:.1f} ms, sluice/vLLM "
                  f"{r['sluice_over_vllm']:.2f}, cosine to transformers min "
                  f"{r['vllm_cosine_min']:.4f}")
    print(json.dumps({"benchmark": "embeddings", "cpu": cpu_info(), "model": path,
                      "dtype": args.dtype, "peer_pooling": args.peer_pooling,
                      "batch": args.batch, "concurrency": args.concurrency,
                      "peer_batch": args.peer_batch, "cpus": os.cpu_count(), "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
