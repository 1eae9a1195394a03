"""`sluice sim`: options -> configs -> one simulation per policy -> the bench's report.

    1. the profile (file, calibrated default, or built-in) with any overrides
    2. the workload: a trace's rows (its own times, time-scaled or reshaped to a day's
       rate), or a bench workload with its arrival process
    3. one `Simulation` per policy (`--policy`, then each of `--compare`), same sessions,
       each with a fresh replica planner (`--planner`: fixed, or the production one)
    4. `sluice.bench.report.table` (the rows of `sluice bench serve`) plus the rows only a
       simulator has; `--json`, `--plot`; the last stdout line is one JSON document
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from sluice.bench import report
from sluice.bench.load import LoadConfig, check_burstiness
from sluice.bench.metrics import parse_slos
from sluice.bench.workloads import WORKLOADS, Session, WorkloadConfig
from sluice.control.flags import (
    FLAGS,
    changed_scaling_options,
    check_policy_flags,
    named_by_flags,
    scaling_options,
)
from sluice.control.planner import SLO, PlannerConfig
from sluice.protocol.errors import InvalidRequestError
from sluice.sim.cluster import SimConfig, SimResult, Simulation
from sluice.sim.planner import PLANNERS, make_planner
from sluice.sim.profile import StepProfile, load_profile
from sluice.sim.router import RouterSimConfig
from sluice.sim.workload import DailyShape, synthetic_sessions, trace_sessions

DEFAULT_NUM_PROMPTS = 100
# `sluice sim` flag dest -> (the option's name in the bench's WORKLOADS[...].uses, flag)
WORKLOAD_FLAGS: dict[str, tuple[str, str]] = {
    "trace": ("trace_path", "--trace"),
    "input_len": ("input_len", "--input-len"),
    "output_len": ("output_len", "--output-len"),
    "random_range_ratio": ("range_ratio", "--random-range-ratio"),
    "num_groups": ("num_groups", "--num-groups"),
    "system_prompt_len": ("system_prompt_len", "--system-prompt-len"),
    "num_turns": ("num_turns", "--num-turns"),
    "token_scale": ("token_scale", "--token-scale"),
    "output_token_scale": ("output_token_scale", "--output-token-scale"),
    "time_scale": ("time_scale", "--time-scale"),
    "request_rate": ("request_rate", "--request-rate"),
    "burstiness": ("burstiness", "--burstiness"),
}
_CONFIG_FIELDS = {f.name for f in fields(WorkloadConfig)} - {"trace_path"}
DEFAULT_SHARED_PREFIX_LEN = 256
DEFAULT_WORKERS = 16

# (label, key, format): what `sluice bench serve` cannot know
SIM_ROWS: tuple[tuple[str, str, str], ...] = (
    ("Prefix cache hit rate (oracle)", "oracle_prefix_cache_hit_rate", ".3f"),
    ("Hit rate vs oracle", "hit_rate_vs_oracle", ".3f"),
    ("Worker-hours", "worker_hours", ".3f"),
    ("SLO attainment (requests)", "slo_attainment", ".3f"),
    ("Goodput per worker-second", "goodput_per_worker_s", ".4f"),
    ("Scale events", "scale_events", "d"),
    ("Busiest worker / mean (requests)", "busiest_over_mean", ".2f"),
    ("Mean worker busy fraction", "mean_worker_busy", ".3f"),
    ("Engine steps", "engine_steps", "d"),
    ("Events", "events", "d"),
    ("Simulation wall time (s)", "wall_s", ".2f"),
    ("Events per second", "events_per_s", ".0f"),
)


NO_PROFILE_NOTE = ("sluice sim: no calibrated profile (run `sluice sim calibrate`); using "
                   "the built-in default")


def profile_path(path: str | None, default_path: str) -> str | None:
    """The profile to load: `--profile`, else the one `calibrate` wrote, if there is one;
    None is the built-in default."""
    if path:
        return path
    return default_path if Path(default_path).exists() else None


def resolve_profile(path: str | None, default_path: str) -> StepProfile:
    """The profile as `profile_path` picks it; the built-in default is said on stderr."""
    found = profile_path(path, default_path)
    if found is None:
        print(NO_PROFILE_NOTE, file=sys.stderr)
        return StepProfile()
    return load_profile(found)


def profile_from_args(args: argparse.Namespace, default_path: str) -> StepProfile:
    """The profile with `args`' overrides; silent (`run_from_args` says when it is the
    built-in default, once every option has been checked)."""
    overhead = args.request_overhead_ms
    if not 0 < args.speedup < math.inf:
        raise InvalidRequestError("--speedup must be > 0 and finite", param="speedup")
    found = profile_path(args.profile, default_path)
    profile = StepProfile() if found is None else load_profile(found)
    if args.speedup != 1:
        profile = profile.faster(args.speedup)
    return profile.with_overrides(
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        request_overhead_s=None if overhead is None else overhead / 1000.0,
        host_contention=args.host_contention)


def _policy_options(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not math.isfinite(out[key.strip()]):  # nan: no worker scores lowest
            raise InvalidRequestError(f"--policy-option {item!r}: expected KEY=NUMBER "
                                      "(finite)", param="policy_option")
    return out


def parse_sim_slos(text: str | None) -> dict[str, float]:
    """The goodput SLOs (`sluice bench`'s: ttft, tpot, e2e), where `itl` is accepted
    for tpot: a request's mean inter-token latency is its TPOT, and `itl` is what the
    production planner's `--slo` calls its target."""
    parts = [p.strip() for p in (text or "").split(",") if p.strip()]
    names = [p.partition("=")[0].strip() for p in parts]
    if "itl" in names and "tpot" in names:
        raise InvalidRequestError("--slo: give itl or tpot, not both (the same target)",
                                  param="slo")
    return parse_slos(",".join("tpot=" + p.partition("=")[2] if n == "itl" else p
                               for n, p in zip(names, parts, strict=True)))


def planner_config(args: argparse.Namespace, slos: dict[str, float]) -> PlannerConfig | None:
    """The production planner's config, or None for `--planner fixed` (which takes none of
    the autoscaling flags: one given is an error, as it would be ignored). Its SLO is
    `--slo`'s ttft and itl (default 2 s, 200 ms)."""
    bounds = (args.min_workers, args.max_workers)
    if args.planner == "fixed":
        if bounds != (None, None):
            raise InvalidRequestError("--min-workers/--max-workers need an autoscaling "
                                      "--planner (slo, queue, kv)", param="planner")
        given = _fixed_pool_ignores(args)
        if given:
            raise InvalidRequestError(f"--planner fixed does not use {', '.join(given)}: "
                                      "they need an autoscaling --planner (slo, queue, kv)",
                                      param="planner")
        return None
    if None in bounds:
        raise InvalidRequestError(f"--planner {args.planner} needs --min-workers and "
                                  "--max-workers", param="min_workers")
    config = named_by_flags(lambda: PlannerConfig(
        policy=args.planner, min_replicas=args.min_workers, max_replicas=args.max_workers,
        slo=planner_slo(slos), **scaling_options(args)))
    check_policy_flags(args.planner, args)  # after the values' own checks
    return config


def _fixed_pool_ignores(args: argparse.Namespace) -> list[str]:
    """The autoscaling flags given to a fixed pool: the sim's own (None unless given) and
    the planner's shared ones set away from their defaults (their parser has defaults)."""
    given = [flag for dest, flag in (("planner_interval", "--planner-interval"),
                                     ("cold_start", "--cold-start"))
             if getattr(args, dest) is not None]
    return given + [FLAGS[name] for name in changed_scaling_options(args)]


def planner_slo(slos: dict[str, float]) -> SLO:
    """The planner's SLO from `--slo`'s targets: ttft (p90) and tpot as the mean ITL (a
    request's TPOT is its mean ITL); the planner's defaults for what is not given."""
    default = SLO()
    return SLO(ttft_s=slos.get("ttft", default.ttft_s), itl_s=slos.get("tpot", default.itl_s))


def initial_workers(args: argparse.Namespace, planning: PlannerConfig | None) -> int:
    """`--workers`, else 16 for a fixed pool and `--min-workers` for an autoscaled one
    (as `sluice serve` starts)."""
    if args.workers is not None:
        if planning is not None and not (planning.min_replicas <= args.workers
                                         <= planning.max_replicas):
            raise InvalidRequestError(f"--workers {args.workers} is outside --min-workers "
                                      f"{planning.min_replicas} .. --max-workers "
                                      f"{planning.max_replicas}", param="workers")
        return int(args.workers)
    return DEFAULT_WORKERS if planning is None else max(1, planning.min_replicas)


def rate_shape(args: argparse.Namespace) -> DailyShape | None:
    if args.rate_shape == "trace":
        for dest, flag in (("duration", "--duration"), ("trough_ratio", "--trough-ratio")):
            if getattr(args, dest) is not None:
                raise InvalidRequestError(f"{flag} needs --rate-shape daily", param=dest)
        return None
    if args.duration is None:
        raise InvalidRequestError("--rate-shape daily needs --duration SECONDS",
                                  param="duration")
    if args.time_scale is not None:
        raise InvalidRequestError("--rate-shape daily sets the arrival times; drop "
                                  "--time-scale", param="time_scale")
    if args.trough_ratio is None:
        return DailyShape(args.duration)
    return DailyShape(args.duration, args.trough_ratio)


def workload_options(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """The `WorkloadConfig` fields given on the command line (the others keep its
    defaults). An option the workload would not read is an error, as in `sluice bench
    serve`: a trace brings its own lengths and times, a synthetic workload has no trace."""
    arrivals = set() if workload == "trace" else {"request_rate", "burstiness"}
    uses = WORKLOADS[workload].uses | arrivals
    given = {dest: field for dest, (field, _) in WORKLOAD_FLAGS.items()
             if getattr(args, dest) is not None}
    unused = [dest for dest, field in given.items() if field not in uses]
    if unused:
        flags = ", ".join(WORKLOAD_FLAGS[dest][1] for dest in unused)
        raise InvalidRequestError(f"--workload {workload} does not use {flags}", param=unused[0])
    return {field: getattr(args, dest) for dest, field in given.items()
            if field in _CONFIG_FIELDS}


def sessions_from_args(args: argparse.Namespace) -> list[tuple[Session, float]]:
    workload = args.workload or ("trace" if args.trace else "random")
    shape = rate_shape(args)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise InvalidRequestError("--num-prompts must be >= 1", param="num_prompts")
    if workload == "trace" and not args.trace:
        raise InvalidRequestError("--workload trace needs --trace FILE", param="trace")
    options = workload_options(args, workload)
    if workload == "trace":
        cfg = WorkloadConfig(seed=args.seed, **options)
        return list(trace_sessions(args.trace, cfg, args.num_prompts, shape).timed())
    if shape is not None:
        raise InvalidRequestError("--rate-shape daily reshapes a trace's arrivals: it needs "
                                  "--trace", param="rate_shape")
    options.setdefault("system_prompt_len",
                       DEFAULT_SHARED_PREFIX_LEN if workload == "shared-prefix" else 0)
    cfg = WorkloadConfig(seed=args.seed, **options)
    rate = math.inf if args.request_rate is None else args.request_rate
    check_burstiness(rate, args.burstiness)
    burstiness = 1.0 if args.burstiness is None else args.burstiness
    load = LoadConfig(request_rate=rate, burstiness=burstiness, seed=args.seed)
    count = DEFAULT_NUM_PROMPTS if args.num_prompts is None else args.num_prompts
    return synthetic_sessions(workload, cfg, load, count)


def configs_from_args(args: argparse.Namespace, profile: StepProfile,
                      planning: PlannerConfig | None = None) -> list[SimConfig]:
    router = RouterSimConfig(
        policy=args.policy, policy_options=_policy_options(args.policy_option),
        block_size=profile.block_size, scrape_interval_s=args.scrape_interval,
        kv_event_lag_s=args.kv_event_lag_ms / 1000.0,
        prefix_index_blocks=args.prefix_index_blocks, seed=args.seed)
    timing = {field: value for field, value in (("planner_interval_s", args.planner_interval),
                                                ("cold_start_s", args.cold_start))
              if value is not None}  # else SimConfig's defaults
    base = SimConfig(workers=initial_workers(args, planning), profile=profile, router=router,
                     max_concurrency=args.max_concurrency, slos=parse_sim_slos(args.slo),
                     **timing)
    policies = list(dict.fromkeys([args.policy, *args.compare]))
    return [replace(base, router=replace(router, policy=p,
                                         policy_options=router.policy_options
                                         if p == args.policy else {}))
            for p in policies]


def simulate(configs: Sequence[SimConfig], sessions: Sequence[tuple[Session, float]],
             planner: str = "fixed", progress: bool = True,
             planning: PlannerConfig | None = None) -> list[SimResult]:
    results = []
    for cfg in configs:
        result = Simulation(cfg, make_planner(planner, cfg.workers, planning)).run(sessions)
        if progress:
            print(f"sluice sim: {cfg.router.policy}: {result.summary['events']} events in "
                  f"{result.summary['wall_s']:.1f}s", file=sys.stderr)
        results.append(result)
    return results


def sim_table(summaries: Sequence[dict[str, Any]]) -> str:
    heads = ["metric", *(str(s["base_url"]) for s in summaries)]
    lines = [[label, *(report._fmt(s.get(key), fmt) for s in summaries)]
             for label, key, fmt in SIM_ROWS]
    widths = [max(len(row[i]) for row in [heads, *lines]) for i in range(len(heads))]
    render = [" | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths, strict=True)))
              for row in [heads, *lines]]
    bar = "=" * len(render[0])
    return "\n".join([" Simulator ".center(len(bar), "="), render[0], "-" * len(bar),
                      *render[1:], bar])


def document(configs: Sequence[SimConfig], results: Sequence[SimResult], workload: str,
             seed: int, planner: str = "fixed", planning: PlannerConfig | None = None
             ) -> dict[str, Any]:
    profile = configs[0].profile
    out = [r.summary | {"requests": [x.to_dict() for x in r.records],
                        "throughput_over_time": report.throughput_over_time(r.records)}
           for r in results]
    doc: dict[str, Any] = {
        "benchmark": "sim",
        "config": {"workload": workload, "seed": seed, "workers": configs[0].workers,
                   "planner": planner, "planner_config": asdict(planning) if planning else None,
                   "cold_start_s": configs[0].cold_start_s,
                   "profile": vars(profile) | {}, "policies": [c.router.policy for c in configs],
                   "slos_ms": {k: v * 1000.0 for k, v in configs[0].slos.items()}},
        "results": out}
    if len(out) > 1:
        doc["ratios"] = [{"base_url": r["base_url"], **rat}
                         for r, rat in zip(out[1:], report.ratios(out), strict=True)]
    return doc


def run_from_args(args: argparse.Namespace) -> int:
    from sluice.sim.cli import default_profile_path

    report.check_output(args.json, "--json")
    report.check_plot(args.plot)
    profile = profile_from_args(args, default_profile_path())
    if args.planner not in PLANNERS:
        raise InvalidRequestError(f"unknown planner {args.planner!r}; choose from "
                                  f"{sorted(PLANNERS)}", param="planner")
    planning = planner_config(args, parse_sim_slos(args.slo))
    configs = configs_from_args(args, profile, planning)
    make_planner(args.planner, configs[0].workers, planning)  # its checks: --min-workers 0
    sessions = sessions_from_args(args)
    # notes come after every option is checked: a bad one is its error alone
    if profile_path(args.profile, default_profile_path()) is None:
        print(NO_PROFILE_NOTE, file=sys.stderr)
    if args.trace and profile.block_size < 512 and configs[0].workers >= 100:
        print("sluice sim: hint: a Mooncake trace's content is 512-token blocks; "
              "--block-size 512 gives the same hit rates with 32x fewer hashes and KV "
              "blocks (see docs/sim.md)", file=sys.stderr)
    results = simulate(configs, sessions, args.planner, planning=planning)
    workload = args.workload or ("trace" if args.trace else "random")
    doc = document(configs, results, workload, args.seed, args.planner, planning)
    print(report.table(doc["results"], title="Simulation Result"))
    print(sim_table(doc["results"]))
    if args.json:
        report.write_json(args.json, doc)
    if args.plot:
        report.plot(args.plot, [(r.summary["base_url"], r.records) for r in results])
    # the replica count per planner tick grows with the simulated time (a day: 86,400)
    print(report.summary_line(doc, (*report.PER_RUN_SERIES, "replicas_over_time")), flush=True)
    return 0 if all(r.summary["completed"] for r in results) else 1
