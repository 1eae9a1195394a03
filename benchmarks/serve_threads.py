"""Two local workers on one machine: CPU threads split between them vs one per core each.

    sluice serve --workers 2 --no-gateway                      (default: cores / 2 each)
    sluice serve --workers 2 --no-gateway --cpu-threads CORES  (each engine on every core,
                                                                what the default was)

each driven by the same `sluice bench serve` loads (seeded random prompts, `--ignore-eos`):
a Poisson rate and a closed loop at fixed concurrency. Prints TTFT/TPOT p50 and output
tokens/s per configuration and load, and the ratio split / per-core. Run under the lock:

    flock /tmp/sluice-heavy.lock env PYTHONPATH=src python benchmarks/serve_threads.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sim_vs_real import RealCluster  # this folder is on sys.path when run as a script

LOADS = {
    "rate 1.5": ["--request-rate", "1.5", "--num-prompts", "40"],
    "concurrency 16": ["--max-concurrency", "16", "--num-prompts", "64"],
}
WORKLOAD = ["--workload", "random", "--input-len", "256", "--output-len", "32",
            "--random-range-ratio", "0.5", "--seed", "0"]
METRICS = ("p50_ttft_ms", "p50_tpot_ms", "output_throughput")


def bench(url: str, load: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "bench", "serve", "--base-url",
                          url, "--ignore-eos", "--disable-tqdm", "--warmup", "2", *WORKLOAD,
                          *load], capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])["results"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    ap.add_argument("--log", default="/tmp/serve_threads.log")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    configs = {"split (default)": [], f"{cores} threads each": ["--cpu-threads", str(cores)]}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, extra in configs.items():
        cluster = RealCluster(extra, Path(args.log))
        try:
            cluster.wait_ready()
            results[name] = {}
            for load in args.loads:
                r = bench(cluster.url, LOADS[load])
                results[name][load] = {k: float(r[k]) for k in METRICS}
                print(f"  {name}, {load}: done", file=sys.stderr)
        finally:
            cluster.stop()
    print(f"{'config':22} {'load':16} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'out tok/s':>10}")
    for name, per_load in results.items():
        for load, r in per_load.items():
            print(f"{name:22} {load:16} {r['p50_ttft_ms']:12.1f} {r['p50_tpot_ms']:12.1f} "
                  f"{r['output_throughput']:10.1f}")
    print(json.dumps({"benchmark": "serve_threads", "cores": cores, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
