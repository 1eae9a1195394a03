"""Issue 12's goodput target in the simulator: the production planner against a fixed pool
sized for the peak, over the Mooncake trace re-timed to a day.

    1. the trace's rows, in order, re-timed so the rate follows a day compressed into
       `--duration` seconds (a sinusoid, trough/peak `--trough-ratio`; docs/sim.md)
    2. the pool sized for the peak: the smallest fixed n whose run of the whole day meets
       the SLO over the peak window (requests arriving within `--peak-window` / 2 of the
       peak: p90 TTFT <= ttft and mean ITL <= itl, the planner's own SLO), found by
       bisection over 1 .. `--max-search` (assuming more workers never do worse)
    3. the production planner (`--planner`, default slo) between `--min-workers` and that
       n, from `--initial-workers` (default: n × trough ratio), same trace, same router
       policy, same step-time profile, `--cold-start` per start
    4. for both: goodput per worker-second (requests meeting the SLO per second of worker
       time, cold starts included), SLO attainment, worker-seconds, scale events; their
       ratio; a plot of the rate and the replicas over time (`--plot`)

    PYTHONPATH=src python benchmarks/autoscale_sim.py --duration 1800 \\
        --trace ../shared/traces/mooncake_synthetic_trace.jsonl --plot docs/img/autoscale-sim.png

The step-time profile is `--profile FILE`, else `$SLUICE_HOME/sim-profile.json`, else the
built-in one (SmolLM2-135M on this machine's CPU, the model whose cold start
docs/control.md measured). Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from sluice.bench.client import RequestRecord
from sluice.bench.workloads import Session, WorkloadConfig
from sluice.control.flags import add_scaling_arguments, scaling_options
from sluice.control.planner import SLO, PlannerConfig
from sluice.sim.cli import default_profile_path
from sluice.sim.cluster import SimConfig, SimResult, Simulation
from sluice.sim.planner import make_planner
from sluice.sim.profile import StepProfile
from sluice.sim.router import RouterSimConfig
from sluice.sim.run import parse_sim_slos, resolve_profile
from sluice.sim.workload import DailyShape, trace_sessions

Timed = Sequence[tuple[Session, float]]


@dataclass(frozen=True)
class PeakCheck:
    """The planner's SLO over the requests that arrived in the peak window."""

    requests: int
    ttft_p90_s: float | None
    itl_mean_s: float | None
    met: bool


def peak_check(records: Sequence[RequestRecord], window: tuple[float, float], slo: SLO
               ) -> PeakCheck:
    inside = [r for r in records if window[0] <= r.start < window[1]]
    ttfts = [r.ttft for r in inside if r.ok and r.ttft is not None]
    itls = [x for r in inside if r.ok for x in r.itls]
    p90 = float(np.percentile(ttfts, 90)) if ttfts else None
    itl = float(np.mean(itls)) if itls else None
    failed = any(not r.ok for r in inside)
    met = (not failed and p90 is not None and p90 <= slo.ttft_s
           and (itl is None or itl <= slo.itl_s))
    return PeakCheck(len(inside), p90, itl, met)


class Bench:
    """One workload, profile and SLO; runs fixed pools and the planner on it."""

    def __init__(self, args: argparse.Namespace, profile: StepProfile, sessions: Timed) -> None:
        self.args = args
        self.sessions = sessions
        self.shape = DailyShape(args.duration, args.trough_ratio)
        self.slos = parse_sim_slos(args.slo)
        self.slo = SLO(ttft_s=self.slos["ttft"], itl_s=self.slos["tpot"])
        half = args.peak_window / 2
        self.window = (args.duration / 2 - half, args.duration / 2 + half)
        self.base = SimConfig(
            workers=1, profile=profile, slos=self.slos, cold_start_s=args.cold_start,
            planner_interval_s=args.planner_interval,
            router=RouterSimConfig(policy=args.policy, block_size=profile.block_size,
                                   seed=args.seed))

    def run(self, workers: int, planner: str, planning: PlannerConfig | None) -> SimResult:
        cfg = replace(self.base, workers=workers, label=f"{planner}:{workers}")
        t0 = time.perf_counter()
        result = Simulation(cfg, make_planner(planner, workers, planning)).run(self.sessions)
        check = peak_check(result.records, self.window, self.slo)
        say(f"  {planner:6s} start {workers:3d}: {time.perf_counter() - t0:6.1f}s wall, "
            f"peak p90 TTFT {fmt_s(check.ttft_p90_s)}, ITL {fmt_s(check.itl_mean_s)}, "
            f"attainment {result.summary['slo_attainment']:.3f}, worker-s "
            f"{result.summary['worker_seconds']:.0f}")
        return result

    def smallest_fixed(self) -> tuple[int, SimResult, list[dict[str, Any]]]:
        """Bisection for the smallest fixed pool that meets the SLO at the peak."""
        trials: dict[int, tuple[SimResult, PeakCheck]] = {}

        def meets(n: int) -> bool:
            result = self.run(n, "fixed", None)
            trials[n] = (result, peak_check(result.records, self.window, self.slo))
            return trials[n][1].met

        lo, hi = 0, self.args.max_search  # lo fails (0 workers), hi must meet it
        if not meets(hi):
            raise SystemExit(f"autoscale_sim: {hi} fixed workers miss the SLO at the peak; "
                             "raise --max-search or relax --slo")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if meets(mid) else (mid, hi)
        log = [{"workers": n, **asdict(c)} for n, (_, c) in sorted(trials.items())]
        return hi, trials[hi][0], log


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}s"


def row(name: str, result: SimResult, check: PeakCheck) -> dict[str, Any]:
    s = result.summary
    return {"pool": name, "requests": len(result.records), "failed": s["failed"],
            "good_requests": s["good_requests"], "slo_attainment": s["slo_attainment"],
            "worker_seconds": s["worker_seconds"],
            "mean_replicas": s["worker_seconds"] / max(result.duration, 1e-9),
            "goodput_per_worker_s": s["goodput_per_worker_s"],
            "scale_events": s["scale_events"], "ttft_p90_ms": s["p90_ttft_ms"],
            "mean_itl_ms": s["mean_itl_ms"], "peak_ttft_p90_s": check.ttft_p90_s,
            "peak_itl_mean_s": check.itl_mean_s, "peak_slo_met": check.met,
            "duration_s": result.duration, "wall_s": s["wall_s"]}


def table(rows: Sequence[dict[str, Any]]) -> str:
    cols = [("pool", "pool", "s"), ("good / requests", None, ""),
            ("attainment", "slo_attainment", ".3f"), ("worker-s", "worker_seconds", ".0f"),
            ("mean replicas", "mean_replicas", ".2f"),
            ("goodput / worker-s", "goodput_per_worker_s", ".4f"),
            ("scale events", "scale_events", "d"), ("TTFT p90 (ms)", "ttft_p90_ms", ".0f"),
            ("ITL mean (ms)", "mean_itl_ms", ".0f")]
    lines = [[h for h, _, _ in cols]]
    for r in rows:
        lines.append([f"{r['good_requests']}/{r['requests']}" if k is None
                      else format(r[k], f) for _, k, f in cols])
    widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
    return "\n".join(" | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
                     for line in lines)


def plot(path: str, bench: Bench, runs: Sequence[tuple[str, SimResult]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, bin_s = bench.args.duration, bench.args.duration / 96
    arrivals = np.array([at for _, at in bench.sessions])
    counts, edges = np.histogram(arrivals, bins=np.arange(0.0, d + bin_s, bin_s))
    mean = len(arrivals) / d
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    top.step(edges[:-1], counts / bin_s, where="post", label="arrivals (per bin)")
    grid = np.linspace(0.0, d, 400)
    top.plot(grid, [mean * bench.shape.relative_rate(t) for t in grid], "--", label="daily shape")
    top.set(ylabel="requests / s", title="Rate")
    for label, result in runs:
        pts = result.summary["replicas_over_time"]
        paid = [p["replicas"] + p["starting"] + p["draining"] for p in pts]
        mid.step([p["t"] for p in pts], paid, where="post", label=label)
        starts = np.array([r.start for r in result.records if r.ok and r.ttft is not None])
        ttfts = np.array([r.ttft for r in result.records if r.ok and r.ttft is not None])
        which = np.digitize(starts, edges) - 1
        p90 = [np.percentile(ttfts[which == i], 90) if np.any(which == i) else np.nan
               for i in range(len(edges) - 1)]
        low.step(edges[:-1], p90, where="post", label=label)
    mid.set(ylabel="workers (paid)", title="Replicas: serving + starting + draining")
    low.axhline(bench.slo.ttft_s, color="grey", linestyle=":", label="SLO")
    low.set(ylabel="TTFT p90 (s)", xlabel="time (s)", yscale="log", title="TTFT p90 per bin")
    for ax in (top, mid, low):
        ax.axvspan(*bench.window, color="orange", alpha=0.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def profile_from(args: argparse.Namespace) -> StepProfile:
    profile = resolve_profile(args.profile, default_profile_path())
    f = args.speedup
    return profile.faster(f).with_overrides(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        name=f"{profile.name} / {f:g}" if f != 1 else profile.name)


def itl_floor(spec: str, profile: StepProfile) -> float | None:
    """`--itl-floor`: the profile's one-sequence decode step, none (learn), or seconds."""
    if spec == "learn":
        return None
    if spec == "profile":
        return profile.step_overhead_s + profile.s_per_token + profile.s_per_seq
    return float(spec)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--duration", type=float, default=3600.0,
                    help="the simulated day, seconds (default %(default)s)")
    ap.add_argument("--trough-ratio", type=float, default=0.25,
                    help="lowest rate over highest (default %(default)s)")
    ap.add_argument("--peak-window", type=float, default=None,
                    help="seconds around the peak the fixed pool must meet the SLO in "
                    "(default: a twelfth of the day, two hours of 24)")
    ap.add_argument("--token-scale", type=float, default=1 / 64,
                    help="scale prompt lengths (default 1/64: at 1/32 the longest prompts' "
                    "own prefill puts the p90 TTFT over 3 s at any pool size on the CPU "
                    "profile, so no pool is 'sized for the peak')")
    ap.add_argument("--output-token-scale", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=None, help="first N trace rows")
    ap.add_argument("--slo", default="ttft=3s,itl=300ms",
                    help="a request is good when its TTFT and TPOT meet this; the fixed pool "
                    "must meet it at the peak (p90 TTFT, mean ITL) (default %(default)s)")
    ap.add_argument("--planner-slo", default=None,
                    help="the planner's targets (default: --slo). The planner holds the mean "
                    "ITL to its target while goodput counts each request's TPOT, so a "
                    "tighter ITL here keeps the requests above the mean good")
    ap.add_argument("--planner", default="slo", help="slo | queue | kv (default %(default)s)")
    add_scaling_arguments(ap, "the planner's fewest (default %(default)s)",
                          "the planner's most (default: the peak-sized pool)", min_default=1)
    ap.add_argument("--initial-workers", type=int, default=None,
                    help="the planner's pool at the start of the day (default: the peak-sized "
                    "pool times --trough-ratio, rounded up: where a planner that ran through "
                    "the previous day stands at its trough)")
    ap.add_argument("--itl-floor", default="profile",
                    help="the slo planner's ITL floor (a decode step's fixed cost): 'profile' "
                    "(default: the step profile's one-sequence decode step, as an offline "
                    "profile gives it), 'learn' (only the least ITL the planner sees), or "
                    "seconds")
    ap.add_argument("--trend-window", type=float, default=20.0,
                    help="the slo planner fits the demand's growth over this many seconds "
                    "(default %(default)s)")
    ap.add_argument("--max-step", type=int, default=1,
                    help="the planner's most workers added per decision, and removed "
                    "unless --max-step-down says otherwise (default %(default)s)")
    ap.add_argument("--planner-interval", type=float, default=1.0)
    ap.add_argument("--cold-start", type=float, default=11.0,
                    help="seconds per worker start (default %(default)s: a CPU worker's "
                    "start to first token, docs/control.md)")
    ap.add_argument("--policy", default="cost", help="router policy (default %(default)s)")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--speedup", type=float, default=1.0,
                    help="divide the profile's step times by this (default %(default)s)")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--max-search", type=int, default=48,
                    help="largest fixed pool tried (default %(default)s)")
    ap.add_argument("--fixed-workers", type=int, default=None,
                    help="skip the search: the peak-sized pool has this many")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, metavar="PNG")
    ap.add_argument("--json", default=None, metavar="FILE", help="the document, indented")
    args = ap.parse_args()
    if args.peak_window is None:
        args.peak_window = args.duration / 12
    return args


def main() -> int:
    args = parse_args()
    profile = profile_from(args)
    wl = WorkloadConfig(seed=args.seed, token_scale=args.token_scale,
                        output_token_scale=args.output_token_scale)
    t0 = time.perf_counter()
    sessions = list(trace_sessions(args.trace, wl, args.num_prompts,
                                   DailyShape(args.duration, args.trough_ratio)).timed())
    say(f"trace: {len(sessions)} requests over a {args.duration:g}s day (trough/peak "
        f"{args.trough_ratio:g}) built in {time.perf_counter() - t0:.1f}s; profile "
        f"{profile.name}; cold start {args.cold_start:g}s; SLO {args.slo}")
    bench = Bench(args, profile, sessions)
    if args.fixed_workers is None:
        say("searching the smallest fixed pool that meets the SLO at the peak:")
        peak_n, fixed, search = bench.smallest_fixed()
    else:
        peak_n, search = args.fixed_workers, []
        fixed = bench.run(peak_n, "fixed", None)
    target = bench.slo
    if args.planner_slo is not None:
        slos = parse_sim_slos(args.planner_slo)
        target = SLO(ttft_s=slos.get("ttft", target.ttft_s), itl_s=slos.get("tpot", target.itl_s))
    planning = PlannerConfig(policy=args.planner, min_replicas=args.min_workers,
                             max_replicas=args.max_workers or peak_n, slo=target,
                             itl_floor_s=itl_floor(args.itl_floor, profile),
                             max_step=args.max_step,
                             trend_window_s=args.trend_window,
                             **scaling_options(args))
    initial = args.initial_workers or math.ceil(peak_n * args.trough_ratio - 1e-9)
    initial = min(planning.max_replicas, max(1, planning.min_replicas, initial))
    say(f"the {args.planner} planner, {planning.min_replicas}..{planning.max_replicas} workers, "
        f"starting at {initial}:")
    auto = bench.run(initial, args.planner, planning)
    rows = [row(f"fixed {peak_n} (peak-sized)", fixed,
                peak_check(fixed.records, bench.window, bench.slo)),
            row(f"{args.planner} {planning.min_replicas}-{planning.max_replicas}", auto,
                peak_check(auto.records, bench.window, bench.slo))]
    ratio = rows[1]["goodput_per_worker_s"] / rows[0]["goodput_per_worker_s"]
    print(table(rows))
    print(f"goodput per worker-second, {args.planner} planner over the peak-sized pool: "
          f"{ratio:.2f}x (target >= 1.5x)")
    if args.plot:
        plot(args.plot, bench, [(rows[0]["pool"], fixed), (rows[1]["pool"], auto)])
    doc = {"benchmark": "autoscale_sim", "trace": args.trace, "requests": len(sessions),
           "config": {k: v for k, v in vars(args).items() if k not in ("plot", "json")},
           "profile": asdict(profile), "peak_window_s": list(bench.window),
           "peak_sized_workers": peak_n, "search": search,
           "planner_config": asdict(planning), "results": rows,
           "goodput_per_worker_s_ratio": ratio}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
