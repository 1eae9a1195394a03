"""Agreement with reality: 2 real workers under `sluice bench serve` vs `sluice sim`.

For each workload (random, shared-prefix, multi-turn, a slice of the shared Mooncake
trace; small, seeded, at a fixed Poisson rate or the trace's own times):

    real   `sluice serve --workers 2 --no-gateway --policy P` (2 engine processes, the
           router) driven by `sluice bench serve --ignore-eos`
    sim    `sluice sim` with the same workload options, seed and arrival process, 2
           workers, the same policy, the profile `sluice sim calibrate` fitted here

and print TTFT p50/p90, request and output throughput, and prefix-cache hit rate side by
side (sim / real); the real hit rate is from the engines' own /metrics counters. The real
workers get the profile's KV pool (`--num-kv-blocks`) so both sides have the same cache.
`--calibrate` fits the profile first, in the same locked session as the real run, by
timing one engine alone; `--calibrate-served` fits it to the steps the real workers
log (`--step-log`) while serving a first pass of the same workloads with seed + 1 on a
cluster of their own. Run under `flock /tmp/sluice-heavy.lock`:

    flock /tmp/sluice-heavy.lock env PYTHONPATH=src python benchmarks/sim_vs_real.py

Caveat measured here, not modelled: the two real workers share this machine's CPU
cores, while the profile was fitted on one engine alone.
Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from sluice.bench.metrics import server_deltas
from sluice.control.local import free_port
from sluice.sim.calibrate import outside_engine_s, workers_metrics
from sluice.sim.cli import default_profile_path
from sluice.sim.run import resolve_profile

TRACE = str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"
            / "mooncake_synthetic_trace.jsonl")
# (options for both sides, real-only, sim-only); arrivals: Poisson at --request-rate,
# except the trace slice, which keeps the trace's own times (x4: ~1 req/s)
WORKLOADS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "random": (["--workload", "random", "--input-len", "256", "--output-len", "32",
                "--random-range-ratio", "0.5"], ["--num-prompts", "40"], ["--num-prompts", "40"]),
    "shared-prefix": (["--workload", "shared-prefix", "--num-groups", "4",
                       "--system-prompt-len", "512", "--input-len", "64", "--output-len", "32"],
                      ["--num-prompts", "40"], ["--num-prompts", "40"]),
    "multi-turn": (["--workload", "multi-turn", "--num-turns", "4", "--system-prompt-len",
                    "256", "--input-len", "64", "--output-len", "32"],
                   ["--num-sessions", "10"], ["--num-prompts", "10"]),
    "trace": (["--workload", "trace", "--token-scale", "0.015625", "--output-token-scale",
               "0.25", "--time-scale", "4", "--num-prompts", "40"], [], []),
}
METRICS = [("TTFT p50 (ms)", "p50_ttft_ms"), ("TTFT p90 (ms)", "p90_ttft_ms"),
           ("Request throughput (req/s)", "request_throughput"),
           ("Output throughput (tok/s)", "output_throughput"),
           ("Prefix cache hit rate", "server_prefix_cache_hit_rate"),
           ("TPOT p50 (ms)", "p50_tpot_ms")]


def last_json(out: str) -> dict[str, Any]:
    return json.loads(out.strip().splitlines()[-1])


def cli(*argv: str, timeout: float = 900) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env=os.environ.copy())
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"sluice {' '.join(argv[:2])} failed: {proc.stderr[-2000:]}")
    return last_json(proc.stdout)


class RealCluster:
    """`sluice serve --workers 2 --no-gateway [extra]` (benchmarks/serve_threads.py too)."""

    def __init__(self, extra: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice.cli", "serve", "--workers", "2", "--no-gateway",
             "--port", str(self.port), *extra], stdout=log.open("w"), stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("sluice serve exited")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError("sluice serve did not become ready")

    def worker_urls(self, log: Path) -> list[str]:
        """The engines' own URLs, from `sluice serve`'s "pool M: ready URL {...}" lines."""
        urls: list[str] = []
        for line in log.read_text().splitlines():
            if ": ready http" in line:
                url = line.split(": ready ", 1)[1].split()[0]
                if url not in urls:
                    urls.append(url)
        return urls

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def calibrate(path: str) -> None:
    """`sluice sim calibrate` now, in this locked session: the real run sees the same
    machine (on a shared host, minutes apart can differ by 2x), with the threads each of
    the 2 real workers gets (`sluice serve --workers 2` splits the cores)."""
    sim_calibrate(path, "--cpu-threads", str(max(1, len(os.sched_getaffinity(0)) // 2)))


def sim_calibrate(path: str, *options: str) -> None:
    """`sluice sim calibrate --out path OPTIONS`; its table to stderr."""
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "sim", "calibrate", "--out",
                           path, *options], capture_output=True, text=True,
                          env=os.environ.copy())
    if proc.returncode != 0:
        raise RuntimeError(f"calibrate {' '.join(options)} failed: {proc.stderr[-2000:]}")
    print(proc.stdout, file=sys.stderr)


def calibrate_served(path: str, args: argparse.Namespace, kv_blocks: int) -> None:
    """Fit the profile to the steps the real workers log while serving a first pass of
    every workload (seed + 1), on a cluster of its own (the compared pass then starts
    with cold caches): the served step times, host contention included."""
    steps = tempfile.mkdtemp(prefix="sluice-steps-")
    cluster = RealCluster(["--policy", args.policy, "--num-kv-blocks", str(kv_blocks),
                           "--step-log", steps], Path(args.log + ".fit"))
    outside: list[float] = []
    try:
        cluster.wait_ready()
        engines = cluster.worker_urls(Path(args.log + ".fit"))
        for name in args.workloads:
            before = workers_metrics(engines)
            real = run_real(cluster, name, str(int(args.seed) + 1), args)
            outside.append(outside_engine_s(float(real["mean_ttft_ms"]) / 1e3, before,
                                            workers_metrics(engines)))
            print(f"  fit pass {name}: {outside[-1] * 1e3:.1f} ms a request outside the "
                  "engine", file=sys.stderr)
    finally:
        cluster.stop()
    sim_calibrate(path, "--from-steps", steps)
    if args.request_overhead_ms is None:  # measured, unless given
        profile = json.loads(Path(path).read_text())
        profile["request_overhead_s"] = max(0.0, statistics.median(outside))
        Path(path).write_text(json.dumps(profile, indent=2) + "\n")


def workload_args(name: str, seed: str, args: argparse.Namespace) -> list[str]:
    """Both sides' options for one workload: its own, the seed, the arrivals."""
    both, _, _ = WORKLOADS[name]
    return [*both, "--seed", seed, *(["--trace", args.trace] if name == "trace"
                                     else ["--request-rate", args.request_rate])]


def run_real(cluster: RealCluster, name: str, seed: str,
             args: argparse.Namespace) -> dict[str, Any]:
    return cli("bench", "serve", "--base-url", cluster.url, "--ignore-eos", "--disable-tqdm",
               "--warmup", "0", *workload_args(name, seed, args),
               *WORKLOADS[name][1])["results"][0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None)
    ap.add_argument("--policy", default="cost")
    ap.add_argument("--request-rate", default="1.5")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--seed", default="0")
    ap.add_argument("--trace", default=TRACE, help="the trace slice's Mooncake file")
    ap.add_argument("--request-overhead-ms", default=None,
                    help="the simulator's HTTP + tokenizing time per request (profile's)")
    ap.add_argument("--host-contention", default=None,
                    help="the simulator's shared-host slowdown per other busy worker "
                    "(profile's; both real workers share this machine's cores)")
    ap.add_argument("--log", default="/tmp/sim_vs_real_serve.log")
    ap.add_argument("--calibrate", action="store_true",
                    help="run `sluice sim calibrate` first (one engine alone; writes --profile)")
    ap.add_argument("--calibrate-served", action="store_true",
                    help="fit --profile to the steps the real workers log serving a first "
                    "pass of the workloads (seed + 1; `sluice sim calibrate --from-steps`), "
                    "and its request overhead to their TTFT outside the engines (median "
                    "over the workloads) unless --request-overhead-ms is given")
    args = ap.parse_args()
    profile_path = args.profile or default_profile_path()
    if args.calibrate:
        calibrate(profile_path)
    if args.calibrate_served:
        kv_blocks = resolve_profile(profile_path if Path(profile_path).exists() else None,
                                    default_profile_path()).num_kv_blocks
        calibrate_served(profile_path, args, kv_blocks)
    profile = resolve_profile(profile_path if Path(profile_path).exists() else None,
                              default_profile_path())
    sim_args = ["--workers", "2", "--policy", args.policy, "--profile", profile_path] \
        if Path(profile_path).exists() else ["--workers", "2", "--policy", args.policy]
    if args.request_overhead_ms is not None:
        sim_args += ["--request-overhead-ms", args.request_overhead_ms]
    if args.host_contention is not None:
        sim_args += ["--host-contention", args.host_contention]

    results: dict[str, dict[str, Any]] = {}
    cluster = RealCluster(["--policy", args.policy, "--num-kv-blocks",
                           str(profile.num_kv_blocks)], Path(args.log))
    try:
        cluster.wait_ready()
        engines = cluster.worker_urls(Path(args.log))
        for name in args.workloads:
            before = workers_metrics(engines)
            real = run_real(cluster, name, args.seed, args)
            deltas = server_deltas({"workers": before}, {"workers": workers_metrics(engines)})
            real |= {f"server_{k}": v for k, v in deltas.items()}
            sim = cli("sim", *workload_args(name, args.seed, args), *WORKLOADS[name][2],
                      *sim_args)["results"][0]
            results[name] = {"real": real, "sim": sim}
            print(f"  {name}: done", file=sys.stderr)
    finally:
        cluster.stop()

    print(f"profile: {profile.name} ({profile.source})")
    print(f"{'workload':14} {'metric':28} {'real':>10} {'sim':>10} {'sim/real':>9}")
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, pair in results.items():
        table[name] = {}
        for label, key in METRICS:
            r, s = pair["real"].get(key), pair["sim"].get(key)
            ratio = s / r if isinstance(r, int | float) and isinstance(s, int | float) and r else None
            table[name][key] = {"real": r, "sim": s, "ratio": ratio}
            fr = "-" if r is None else f"{r:10.3f}"
            fs = "-" if s is None else f"{s:10.3f}"
            fq = "-" if ratio is None else f"{ratio:9.3f}"
            print(f"{name:14} {label:28} {fr:>10} {fs:>10} {fq:>9}")
    print(json.dumps({"benchmark": "sim_vs_real", "policy": args.policy,
                      "request_rate": args.request_rate, "profile": vars(profile),
                      "sim_args": sim_args, "workloads": {k: WORKLOADS[k] for k in results},
                      "results": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
