"""Cold start of one worker: from "scale up" to its first token, and where the time goes.

Two measurements on the default model (or `--model`):

1. end to end, as the controller sees it: `LocalBackend.start()` launches a
   `sluice worker` and returns once /health answers 200; then one streamed request's
   first token. Repeated `--rounds` times (a fresh process each time).
2. the breakdown, in a fresh child process that performs a worker engine's start-up
   steps one by one with a timer around each:

       python + imports   interpreter start, torch and sluice imported
       weights            load_model: read the checkpoint, dequantize, build the module
       tokenizer          load_tokenizer
       kv cache           allocate and zero the KV pool
       kernels            native_ops + cpu_linear: the CPU kernels (cached build)

   and warm-up from (1): the first request's time to first token minus the second's.

The worker process itself adds the HTTP server and the engine core's own process on
top of these; (1) minus the sum of (2) is that overhead.

    python benchmarks/coldstart.py [--model PATH] [--rounds 2]

Each is run without the converted-weights cache (`SLUICE_WEIGHTS_CACHE=off`) and with
one in a fresh temporary directory (its first start fills it; the later ones read it).

The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

BREAKDOWN = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from sluice.engine.config import EngineConfig
from sluice.engine import model_runner as mr
t_import = time.perf_counter()
cfg = EngineConfig.from_options(sys.argv[1], max_model_len=512, num_kv_blocks=128)
mc = cfg.model
device, dtype = mr.resolve_device(mc)
model, model_config = mr.load_model(mc.model, device, dtype, mc.revision)
t_weights = time.perf_counter()
tok = mr.load_tokenizer(mc.tokenizer or mc.model, mc.revision)
t_tok = time.perf_counter()
runner = mr.ModelRunner.__new__(mr.ModelRunner)
runner.model, runner.model_config, runner.device, runner.dtype = model, model_config, device, dtype
runner.block_size, runner.num_kv_blocks = cfg.cache.block_size, 128
runner._allocate_kv_cache()
model.init_rope(512)
t_kv = time.perf_counter()
native = mr.native_ops(mc.kernel_backend, device, dtype)
linear = mr.cpu_linear(mc.kernel_backend, device, dtype)
t_kernels = time.perf_counter()
print(json.dumps({"imports_s": t_import - t0, "weights_s": t_weights - t_import,
                  "tokenizer_s": t_tok - t_weights, "kv_cache_s": t_kv - t_tok,
                  "kernels_s": t_kernels - t_kv}))
"""


def breakdown(model: str, env: dict[str, str]) -> dict[str, float]:
    """The engine's start-up steps timed in a fresh interpreter (its own start included)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", BREAKDOWN, model], capture_output=True,
                         text=True, check=True, env={**os.environ, **env})
    total = time.perf_counter() - t0
    steps: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    steps["child_total_s"] = total
    return steps


async def end_to_end(model: str, env: dict[str, str]) -> dict[str, float]:
    from sluice.control.local import LocalBackend

    backend = LocalBackend(["--model", model, "--max-model-len", "512", "--num-kv-blocks",
                            "128", "--log-level", "warning"], kv_events=False,
                           startup_timeout_s=600, poll_s=0.05, env=env)
    t0 = time.perf_counter()
    worker = await backend.start()
    ready = time.perf_counter() - t0
    body = {"model": "x", "prompt": "Hello, how are you", "max_tokens": 4, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            models = (await client.get(worker.url + "/v1/models")).json()["data"]
            body["model"] = models[0]["id"]
            first = await first_token(client, worker.url, body)
            warm = await first_token(client, worker.url, body)
    finally:
        await backend.close()
    return {"ready_s": ready, "first_token_s": first, "warm_first_token_s": warm,
            "warm_up_s": first - warm, "total_s": ready + first}


async def first_token(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                break
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the shipped SmolLM2 GGUF")
    parser.add_argument("--rounds", type=int, default=2, help="starts per setting")
    args = parser.parse_args()
    if args.model is None:
        from sluice.engine.tokenizer import resolve_model

        args.model = resolve_model(None)
    cache = tempfile.mkdtemp(prefix="sluice-coldstart-cache-")
    settings = {"no weights cache": {"SLUICE_WEIGHTS_CACHE": "off"},
                "weights cache (filled by its first start)": {"SLUICE_WEIGHTS_CACHE": cache}}
    result: dict[str, Any] = {"model": args.model, "settings": {}}
    print(f"{'setting':<44} {'round':>5} {'ready (s)':>10} {'1st token (s)':>14} {'total (s)':>10}")
    for name, env in settings.items():
        runs = [asyncio.run(end_to_end(args.model, env)) for _ in range(args.rounds)]
        steps = breakdown(args.model, env)
        result["settings"][name] = {"end_to_end": runs, "breakdown": steps}
        for i, r in enumerate(runs):
            print(f"{name:<44} {i:>5} {r['ready_s']:>10.2f} {r['first_token_s']:>14.3f} "
                  f"{r['total_s']:>10.2f}")
        print("  breakdown (fresh interpreter): " + ", ".join(
            f"{k} {v:.2f}" for k, v in steps.items()))
    shutil.rmtree(cache, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
