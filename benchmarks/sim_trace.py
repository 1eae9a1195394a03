"""The simulator on a Mooncake trace: speed at 16 / 128 / 1,000 workers, and a policy table.

For each worker count and each router policy, replay the whole trace (or `--limit` rows)
through `sluice.sim` and report: prefix-cache hit rate against the oracle (one infinite
cache), goodput under `--slo`, TTFT p90, worker-hours; and the simulator's own speed
(wall seconds, events, events/s). Targets (issue 20): the whole trace at 1,000 workers in
<= 60 s, 16 workers in <= 5 s, on this machine.

`--planner slo` (or queue, kv) adds, for each worker count N and policy, a run of the
production planner between 1 and N workers (starting at 1, as `sluice serve
--min-workers 1` does): its worker-hours and goodput against the fixed pool of N.

    PYTHONPATH=src python benchmarks/sim_trace.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl
    ... --workers 1000 --policies cost --profile-run      # cProfile of one run, top 25

The step-time profile is `--profile FILE`, else `$SLUICE_HOME/sim-profile.json` (what
`sluice sim calibrate` writes), else the built-in default. Prints a table; the last
stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import pstats
import sys
import time
from dataclasses import replace
from typing import Any

from sluice.bench.metrics import parse_slos
from sluice.bench.workloads import WorkloadConfig
from sluice.control.planner import PlannerConfig
from sluice.sim.cli import default_profile_path
from sluice.sim.cluster import SimConfig, Simulation
from sluice.sim.planner import ReplicaPlanner, make_planner
from sluice.sim.router import RouterSimConfig
from sluice.sim.run import planner_slo, resolve_profile
from sluice.sim.workload import trace_sessions

POLICIES = ["cost", "kv", "prefix", "least_load", "session", "round_robin"]


def digest(records: list[Any], summary: dict[str, Any]) -> str:
    """SHA-256 of every request record and of the summary without its wall times: two
    runs with equal digests made the same decisions at the same virtual times."""
    h = hashlib.sha256()
    for rec in sorted(records, key=lambda r: r.request_id):
        h.update(repr(vars(rec)).encode())
    stable = {k: v for k, v in summary.items() if k not in ("wall_s", "events_per_s")}
    h.update(json.dumps(stable, sort_keys=True, default=repr).encode())
    return h.hexdigest()


def one(cfg: SimConfig, sessions: list[Any], planner: ReplicaPlanner | None = None
        ) -> dict[str, Any]:
    # the previous run's objects go first (a run turns the cyclic GC off; its cycles
    # would otherwise live on through the next run, which would pay for them)
    gc.collect()
    t0 = time.perf_counter()
    result = Simulation(cfg, planner).run(sessions)
    wall = time.perf_counter() - t0
    s = result.summary
    return {"digest": digest(result.records, s), "workers": cfg.workers,
            "policy": cfg.router.policy, "planner": "fixed", "wall_s": wall,
            "events": s["events"], "events_per_s": s["events"] / wall,
            "completed": s["completed"], "failed": s["failed"],
            "hit_rate": s["server_prefix_cache_hit_rate"],
            "oracle_hit_rate": s["oracle_prefix_cache_hit_rate"],
            "hit_rate_vs_oracle": s["hit_rate_vs_oracle"], "goodput": s.get("goodput"),
            "ttft_p50_ms": s["p50_ttft_ms"], "ttft_p90_ms": s["p90_ttft_ms"],
            "tpot_p90_ms": s["p90_tpot_ms"], "worker_hours": s["worker_hours"],
            "duration_s": s["duration_s"], "busiest_over_mean": s["busiest_over_mean"],
            "preemptions": s["server_num_preemptions"],
            "scale_events": s.get("scale_events", 0)}


def autoscaled(cfg: SimConfig, sessions: list[Any], policy: str, most: int,
               slos: dict[str, float]) -> dict[str, Any]:
    """The production planner (`policy`) between 1 and `most` workers, its SLO `--slo`'s."""
    planning = PlannerConfig(policy=policy, min_replicas=1, max_replicas=most,
                             slo=planner_slo(slos))
    row = one(replace(cfg, workers=1), sessions, make_planner(policy, 1, planning))
    return row | {"workers": most, "planner": policy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 128, 1000])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--block-size", type=int, default=512,
                    help="KV block tokens (default %(default)s: the trace's own granularity)")
    ap.add_argument("--num-kv-blocks", type=int, default=2048,
                    help="KV pool per worker in blocks (default %(default)s: 1M tokens)")
    ap.add_argument("--speedup", type=float, default=100.0,
                    help="divide the profile's step times by this (default %(default)s: a "
                    "15k-token prefill of the CPU profile takes ~2 s, the order of an 8B "
                    "model on one datacenter GPU; an illustration, not a measurement)")
    ap.add_argument("--slo", default="ttft=2s,tpot=100ms")
    ap.add_argument("--limit", type=int, default=None, help="first N trace rows only")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--planner", choices=["slo", "queue", "kv"], default=None,
                    help="also run this production planner between 1 and N workers for "
                    "each N and policy (worker-hours and goodput against the fixed N)")
    ap.add_argument("--profile-run", action="store_true",
                    help="cProfile the first configuration and print the top functions")
    args = ap.parse_args()

    profile = resolve_profile(args.profile, default_profile_path())
    f = args.speedup
    profile = profile.faster(f).with_overrides(
        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
        name=f"{profile.name} / {f:g}" if f != 1 else profile.name)
    t0 = time.perf_counter()
    wl = WorkloadConfig(time_scale=args.time_scale)
    sessions = list(trace_sessions(args.trace, wl, args.limit).timed())
    load_s = time.perf_counter() - t0
    print(f"trace: {len(sessions)} requests built in {load_s:.1f}s; profile {profile.name}",
          file=sys.stderr)
    slos = parse_slos(args.slo)
    base = SimConfig(profile=profile, router=RouterSimConfig(block_size=profile.block_size),
                     slos=slos)
    rows = []
    for n in args.workers:
        for policy in args.policies:
            cfg = replace(base, workers=n, router=replace(base.router, policy=policy))
            if args.profile_run and not rows:
                prof = cProfile.Profile()
                prof.enable()
                rows.append(one(cfg, sessions))
                prof.disable()
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
            else:
                rows.append(one(cfg, sessions))
            if args.planner:
                rows.append(autoscaled(cfg, sessions, args.planner, n, slos))
            for r in rows[-2 if args.planner else -1:]:
                print(f"  {n:5d} workers {policy:12s} {r['planner']:5s} {r['wall_s']:6.1f}s "
                      f"{r['events_per_s']:9.0f} ev/s  digest {r['digest'][:16]}",
                      file=sys.stderr)

    print(f"{'workers':>7} {'policy':12} {'planner':7} {'hit':>6} {'oracle':>6} {'vs or.':>6} "
          f"{'goodput':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'w-hours':>8} {'scale':>5} {'wall s':>7} "
          f"{'events':>9} {'ev/s':>8}")
    for r in rows:
        print(f"{r['workers']:7d} {r['policy']:12} {r['planner']:7} {r['hit_rate']:6.3f} "
              f"{r['oracle_hit_rate']:6.3f} {r['hit_rate_vs_oracle']:6.3f} "
              f"{r['goodput'] or 0:8.3f} {r['ttft_p50_ms']:9.0f} {r['ttft_p90_ms']:9.0f} "
              f"{r['worker_hours']:8.2f} {r['scale_events']:5d} {r['wall_s']:7.1f} {r['events']:9d} "
              f"{r['events_per_s']:8.0f}")
    print(json.dumps({"benchmark": "sim_trace", "trace": args.trace, "requests": len(sessions),
                      "trace_build_s": load_s, "profile": vars(profile), "slo": args.slo,
                      "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
