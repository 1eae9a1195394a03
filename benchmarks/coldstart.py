"""Cold start of one worker: from "scale up" to its first token, before and after, and
where the time goes.

End to end, as the controller sees it: `LocalBackend.start()` launches a worker and
returns once /health answers 200 (the engine has loaded and run its warm-up forward);
then one streamed request's first token, and a second request's (warm-up left for the
first request = the difference). Settings, in one run, `--rounds` starts each:

    before, no weights cache   the code in --before-src (a checkout from before the
                               change), fresh processes, SLUICE_WEIGHTS_CACHE=off:
                               today's cold start
    before, weights cache      the same with its weights cache (round 0 fills it)
    fresh processes            this code with the zygote off: a new interpreter for the
                               worker and one for its engine core; weights cache
    zygote                     this code's default: the backend's zygote forks each
                               worker, which forks its core; round 0 starts the zygote

Without --before-src the two "before" settings are approximated by switches on this
code (zygote off, SLUICE_WEIGHTS_CACHE=off), which keep every other change.

Breakdown: the engine core's start-up steps timed one by one, in a fresh interpreter
(as a spawned core) and in a child forked from a process that imported everything and
loaded the kernels first (as from the zygote):

    start       interpreter start and imports | the fork
    weights     load_model (GGUF: read, dequantize, fuse; or the weights cache's map)
    tokenizer   load_tokenizer
    kv cache    allocate and zero the KV pool, RoPE tables
    kernels     native_ops + cpu_linear (a cached build: loaded, or already in memory)
    warm-up     ModelRunner.warm_up (not in the "before" code)

What end to end adds on top (the worker's HTTP front end, its own start, IPC, the
health poll) is its ready time minus the breakdown's sum.

    python benchmarks/coldstart.py [--model PATH] [--rounds 3] [--before-src DIR]

Caches live in a fresh temporary directory. The "before" code builds its kernels under
its own TORCH_EXTENSIONS_DIR (~/.cache/sluice/coldstart-before), so other checkouts do
not make it rebuild. The last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

BREAKDOWN = r"""
import json, os, sys, time
t0 = time.perf_counter()
model, mode = sys.argv[1], sys.argv[2]
import torch
from sluice.engine.config import EngineConfig
from sluice.engine import model_runner as mr, native
if mode == "fork":
    native.load_kernels()
t_import = time.perf_counter()
if mode == "fork":
    read, write = os.pipe()
    if os.fork():
        os.close(write)
        with os.fdopen(read) as f:
            print(f.read())
        os.wait()
        sys.exit(0)
    os.close(read)
    out = os.fdopen(write, "w")
else:
    out = sys.stdout
t_start = time.perf_counter()
cfg = EngineConfig.from_options(model, max_model_len=512, num_kv_blocks=128)
mc = cfg.model
device, dtype = mr.resolve_device(mc)
model, model_config = mr.load_model(mc.model, device, dtype, mc.revision)
t_weights = time.perf_counter()
tok = mr.load_tokenizer(mc.tokenizer or mc.model, mc.revision)
t_tok = time.perf_counter()
runner = mr.ModelRunner.__new__(mr.ModelRunner)
runner.model, runner.model_config, runner.device, runner.dtype = model, model_config, device, dtype
runner.block_size, runner.num_kv_blocks, runner.max_model_len = cfg.cache.block_size, 128, 512
runner._allocate_kv_cache()
model.init_rope(512)
t_kv = time.perf_counter()
ops = mr.native_ops(mc.kernel_backend, device, dtype)
linear = mr.cpu_linear(mc.kernel_backend, device, dtype)
if ops is not None:
    model.use_fused_kernels(ops.fused_add_rms_norm, ops.silu_and_mul)
    linear = mr.with_small_rows(ops, linear or torch.nn.functional.linear)
if linear is not None:
    model.use_linear(linear)
runner.native = ops
t_kernels = time.perf_counter()
if hasattr(runner, "warm_up"):
    runner.warm_up()
t_warm = time.perf_counter()
first = {"start_s": t_import - t0} if mode == "fresh" else {"start_s": t_start - t_import}
print(json.dumps({**first, "weights_s": t_weights - t_start, "tokenizer_s": t_tok - t_weights,
                  "kv_cache_s": t_kv - t_tok, "kernels_s": t_kernels - t_kv,
                  "warm_up_s": t_warm - t_kernels}), file=out, flush=True)
"""
STEPS = ("start_s", "weights_s", "tokenizer_s", "kv_cache_s", "kernels_s", "warm_up_s")
WORKER_ARGS = ["--max-model-len", "512", "--num-kv-blocks", "128", "--log-level", "warning"]


def breakdown(model: str, mode: str, env: dict[str, str]) -> dict[str, float]:
    """The engine core's start-up steps ("fresh" interpreter, or "fork"ed after imports)."""
    out = subprocess.run([sys.executable, "-c", BREAKDOWN, model, mode], capture_output=True,
                         text=True, env=env, timeout=900)
    if out.returncode:
        raise RuntimeError(f"breakdown ({mode}) failed:\n{out.stderr[-3000:]}")
    steps: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    steps["sum_s"] = sum(steps.values())
    return steps


async def start_to_first_token(backend: Any) -> dict[str, float]:
    """One scale-up: start a worker, then two requests' time to first token."""
    t0 = time.perf_counter()
    worker = await backend.start()
    ready = time.perf_counter() - t0
    body = {"model": "x", "prompt": "Hello, how are you", "max_tokens": 4, "stream": True,
            "temperature": 0.0}
    try:
        async with httpx.AsyncClient(timeout=300) as client:
            models = (await client.get(worker.url + "/v1/models")).json()["data"]
            body["model"] = models[0]["id"]
            first = await first_token(client, worker.url, body)
            warm = await first_token(client, worker.url, body)
    finally:
        await backend.stop(worker)
    return {"ready_s": ready, "first_token_s": first, "warm_first_token_s": warm,
            "warm_up_left_s": first - warm, "total_s": ready + first}


async def first_token(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                break
    return time.perf_counter() - t0


async def scale_ups(model: str, env: dict[str, str], zygote: bool, rounds: int
                    ) -> tuple[list[dict[str, float]], float | None]:
    """`rounds` starts on one backend (so round 0 starts the zygote, later ones fork);
    and the zygote's resident memory (MiB) at the end, if there is one."""
    from sluice.control.local import LocalBackend

    backend = LocalBackend(["--model", model, *WORKER_ARGS], kv_events=False,
                           startup_timeout_s=900, poll_s=0.05, env=env, zygote=zygote)
    try:
        runs = [await start_to_first_token(backend) for _ in range(rounds)]
        return runs, resident_mib(backend.zygote.process.pid) if backend.zygote else None
    finally:
        await backend.close()


def resident_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))
    return int(kib) / 1024


def settings(before_src: str | None, cache: str) -> dict[str, dict[str, Any]]:
    """name -> environment, zygote on/off, and which code runs."""
    before_env: dict[str, str] = {}
    if before_src:
        extensions = Path.home() / ".cache" / "sluice" / "coldstart-before"
        before_env = {"PYTHONPATH": os.pathsep.join([before_src, os.environ.get("PYTHONPATH", "")]),
                      "TORCH_EXTENSIONS_DIR": str(extensions)}
    return {
        "before, no weights cache": {"env": {**before_env, "SLUICE_WEIGHTS_CACHE": "off"},
                                     "zygote": False, "before": True},
        "before, weights cache": {"env": {**before_env, "SLUICE_WEIGHTS_CACHE": cache},
                                  "zygote": False, "before": True},
        "fresh processes": {"env": {"SLUICE_WEIGHTS_CACHE": cache}, "zygote": False,
                            "before": False},
        "zygote": {"env": {"SLUICE_WEIGHTS_CACHE": cache}, "zygote": True, "before": False},
    }


def steady(runs: list[dict[str, float]], key: str = "total_s") -> float:
    """The median of the rounds after the first (which fills caches, starts the zygote)."""
    return statistics.median(r[key] for r in (runs[1:] or runs))


def report(result: dict[str, Any]) -> None:
    print(f"\n{'setting':<26} {'round':>5} {'ready (s)':>10} {'1st token (s)':>14} "
          f"{'left to warm (s)':>17} {'total (s)':>10}")
    for name, runs in result["end_to_end"].items():
        for i, r in enumerate(runs):
            print(f"{name:<26} {i:>5} {r['ready_s']:>10.2f} {r['first_token_s']:>14.3f} "
                  f"{r['warm_up_left_s']:>17.3f} {r['total_s']:>10.2f}")
    print(f"\n{'breakdown (s)':<26} " + " ".join(f"{s.removesuffix('_s'):>9}" for s in STEPS)
          + f" {'sum':>7}")
    for name, steps in result["breakdown"].items():
        print(f"{name:<26} " + " ".join(f"{steps.get(s, 0.0):>9.2f}" for s in STEPS)
              + f" {steps['sum_s']:>7.2f}")
    if "zygote_rss_mib" in result:
        print(f"\nzygote resident memory: {result['zygote_rss_mib']:.0f} MiB")
    print()
    for name, ratio in result["ratios"].items():
        print(f"{name}: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the shipped SmolLM2 GGUF")
    parser.add_argument("--rounds", type=int, default=3, help="starts per setting (>= 2)")
    parser.add_argument("--before-src", default=None,
                        help="the src/ folder of a checkout from before the change")
    args = parser.parse_args()
    if args.model is None:
        from sluice.engine.tokenizer import resolve_model

        args.model = resolve_model(None)
    cache = tempfile.mkdtemp(prefix="sluice-coldstart-cache-")
    result: dict[str, Any] = {"model": args.model, "before_src": args.before_src,
                              "rounds": args.rounds, "end_to_end": {}, "breakdown": {}}
    try:
        for name, s in settings(args.before_src, cache).items():
            env = {**os.environ, **s["env"]}
            runs, rss = asyncio.run(scale_ups(args.model, env, s["zygote"], args.rounds))
            result["end_to_end"][name] = runs
            if rss is not None:
                result["zygote_rss_mib"] = rss
            print(f"{name}: " + ", ".join(f"{r['total_s']:.2f}" for r in
                                          result["end_to_end"][name]) + " s", flush=True)
            if name.startswith("before"):
                result["breakdown"][f"{name} (fresh)"] = breakdown(args.model, "fresh", env)
        env = {**os.environ, "SLUICE_WEIGHTS_CACHE": cache}
        result["breakdown"]["now (fresh interpreter)"] = breakdown(args.model, "fresh", env)
        result["breakdown"]["now (forked, as by zygote)"] = breakdown(
            args.model, "fork", {**env, "OPENBLAS_NUM_THREADS": "1",
                                 "OMP_WAIT_POLICY": "PASSIVE"})
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    e2e = result["end_to_end"]
    result["ratios"] = {
        "before (no weights cache) / zygote": steady(e2e["before, no weights cache"])
        / steady(e2e["zygote"]),
        "before (weights cache) / zygote": steady(e2e["before, weights cache"])
        / steady(e2e["zygote"]),
        "fresh processes / zygote": steady(e2e["fresh processes"]) / steady(e2e["zygote"]),
    }
    report(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
