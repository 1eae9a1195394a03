"""`sluice sim` (replay a workload on a simulated cluster) and `sluice sim calibrate`.

    sluice sim --trace FILE --workers 1000 --policy cost --compare kv,round_robin \\
               --slo ttft=2s,tpot=100ms --json out.json --plot out.png
    sluice sim --workload shared-prefix --num-prompts 200 --request-rate 4 --workers 4
    sluice sim --trace FILE --rate-shape daily --duration 3600 --planner slo \\
               --min-workers 1 --max-workers 12 --slo ttft=2s,itl=200ms
    sluice sim calibrate              # fit the step-time model on this machine's engine
    sluice sim calibrate --from-steps DIR   # ... or to steps workers logged while serving

Options are parsed here (the edge) into `SimConfig`s; `sluice.sim.run` does the rest.
The step-time profile is `--profile FILE`, else the one `calibrate` wrote to
`$SLUICE_HOME/sim-profile.json`, else a built-in default (said on stderr).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sluice import env
from sluice.control.flags import add_scaling_arguments
from sluice.protocol.errors import SluiceError


def default_profile_path() -> str:
    return str(env.home() / "sim-profile.json")


def register(subparsers: Any) -> None:
    sim = subparsers.add_parser(
        "sim", allow_abbrev=False,  # `calibrate --out` is not an abbreviation of ours
        help="cluster simulator: the real router and engine scheduler in virtual time",
        description="Replay a workload or a Mooncake trace on N simulated workers that run "
        "sluice's real router policies, engine scheduler and block manager in virtual time, "
        "with the forward pass replaced by a calibrated step-time model. Prints the same "
        "report as `sluice bench serve`; the last stdout line is one JSON document.")
    add_run_arguments(sim)
    sim.set_defaults(func=_run)
    sub = sim.add_subparsers(dest="sim_command", metavar="SIM")
    cal = sub.add_parser("calibrate", help="measure the real engine on this machine and fit "
                         "the step-time profile")
    add_calibrate_arguments(cal)
    cal.set_defaults(func=_calibrate)


def _policies(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="Mooncake JSONL trace (implies --workload "
                   "trace; default: none)")
    w.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn", "trace"],
                   default=None, help="default: trace with --trace, else random")
    w.add_argument("--seed", type=int, default=0,
                   help="workload, arrival and router RNG (default %(default)s)")
    w.add_argument("--num-prompts", type=int, default=None,
                   help="requests (sessions for multi-turn); default 100, or every trace row")
    w.add_argument("--input-len", type=int, default=None, help="synthetic (default 128)")
    w.add_argument("--output-len", type=int, default=None, help="synthetic (default 128)")
    w.add_argument("--random-range-ratio", type=float, default=None,
                   help="random, multi-turn: length spread (default 0)")
    w.add_argument("--num-groups", type=int, default=None,
                   help="shared-prefix groups (default 4)")
    w.add_argument("--system-prompt-len", type=int, default=None,
                   help="shared-prefix / multi-turn system prompt tokens (default 256 / 0)")
    w.add_argument("--num-turns", type=int, default=None,
                   help="multi-turn turns per session (default 4)")
    w.add_argument("--token-scale", type=float, default=None,
                   help="trace: scale input tokens (default 1)")
    w.add_argument("--output-token-scale", type=float, default=None,
                   help="trace: scale output tokens (default 1)")
    w.add_argument("--time-scale", type=float, default=None,
                   help="trace: multiply timestamps (0.5 replays at twice the rate; default 1)")
    w.add_argument("--rate-shape", choices=["trace", "daily"], default="trace",
                   help="trace: its own times; daily: the rows, in order, re-timed so the "
                   "rate follows a day (a sinusoid from trough at 0 to peak at half "
                   "--duration) (default %(default)s)")
    w.add_argument("--duration", type=float, default=None,
                   help="--rate-shape daily: the simulated day in seconds (default: none; "
                   "--rate-shape daily needs it)")
    w.add_argument("--trough-ratio", type=float, default=None,
                   help="--rate-shape daily: lowest rate over highest (default 0.25)")
    w.add_argument("--request-rate", type=float, default=None,
                   help="synthetic: requests/s, Poisson (default inf: all at once)")
    w.add_argument("--burstiness", type=float, default=None,
                   help="synthetic: gamma shape of the gaps (default 1: Poisson)")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="cap on requests in flight (default: no cap)")

    c = p.add_argument_group("cluster")
    c.add_argument("--workers", type=int, default=None,
                   help="workers at the start (default 16; with an autoscaling --planner, "
                   "--min-workers)")
    c.add_argument("--policy", default="cost", help="router policy (default %(default)s)")
    c.add_argument("--compare", type=_policies, default=[], metavar="P1,P2",
                   help="also run these policies on the same workload, one column each "
                   "(default: none)")
    c.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="passed to the policy (numbers), e.g. prefix_weight=3 (default: none)")
    c.add_argument("--profile", default=None, help="step-time profile JSON (default: "
                   "$SLUICE_HOME/sim-profile.json if present, else built-in)")
    c.add_argument("--speedup", type=float, default=1.0,
                   help="divide the profile's step times by this: a device this many times "
                   "faster (e.g. 100 gives the CPU profile's 15k-token prefill ~2 s, the "
                   "order of an 8B model on one datacenter GPU; docs/sim.md) (default 1)")
    c.add_argument("--block-size", type=int, default=None, help="(default: the profile's)")
    c.add_argument("--num-kv-blocks", type=int, default=None, help="per worker (default: the "
                   "profile's)")
    c.add_argument("--max-num-seqs", type=int, default=None, help="(default: the profile's)")
    c.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="(default: the profile's)")
    c.add_argument("--request-overhead-ms", type=float, default=None,
                   help="HTTP + routing time per request outside the engine (default: the "
                   "profile's)")
    c.add_argument("--host-contention", type=float, default=None,
                   help="workers share one CPU host: each other busy worker stretches a "
                   "step by this fraction; 0: a device each (default: the profile's)")
    c.add_argument("--scrape-interval", type=float, default=0.5,
                   help="seconds between the router's scrapes (default %(default)s)")
    c.add_argument("--kv-event-lag-ms", type=float, default=2.0,
                   help="engine step end to the router's prefix index (default %(default)s)")
    c.add_argument("--prefix-index-blocks", type=int, default=200_000,
                   help="blocks the router's prefix index holds (default %(default)s)")
    c.add_argument("--planner", default="fixed",
                   help="replica planner: fixed (--workers), or the production planner's "
                   "policy slo | queue | kv between --min-workers and --max-workers "
                   "(default %(default)s)")
    add_scaling_arguments(c, "autoscale: fewest workers, >= 1 (default: none; an "
                          "autoscaling --planner needs it)",
                          "autoscale: most workers (default: none; an autoscaling "
                          "--planner needs it)")
    c.add_argument("--planner-interval", type=float, default=None,
                   help="autoscale: seconds between planner ticks (default 1.0, the "
                   "controller's)")
    c.add_argument("--cold-start", type=float, default=None,
                   help="autoscale: seconds from a worker's start to serving, paid for "
                   "(default 11.0: measured on CPU, docs/control.md)")

    o = p.add_argument_group("output")
    o.add_argument("--slo", default=None,
                   help="goodput SLOs, e.g. ttft=2s,tpot=100ms (itl = tpot: a request's mean "
                   "ITL); with an autoscaling --planner also its targets (p90 TTFT, mean "
                   "ITL; default ttft=2s,itl=200ms)")
    o.add_argument("--json", default=None, metavar="FILE",
                   help="everything, per request too (default: not written)")
    o.add_argument("--plot", default=None, metavar="PNG",
                   help="latency CDFs, throughput (default: not drawn)")


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="profile file (default $SLUICE_HOME/"
                   "sim-profile.json)")
    p.add_argument("--model", default=None, help="model (default: sluice's SmolLM2)")
    p.add_argument("--quick", action="store_true", help="fewer points (a smoke test)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repeats per point (default %(default)s)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool of the profiled engine (default: what the engine sizes)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="the engine's CPU threads, as the workers to model run it (`sluice "
                   "serve --workers N` gives each cores / N; default: one per core)")
    p.add_argument("--from-steps", nargs="+", default=None, metavar="PATH",
                   help="fit to the steps real workers logged while serving (their "
                   "`--step-log DIR`; files or directories) instead of timing an engine "
                   "alone: each step shape's mean, host contention included (default: "
                   "time an engine)")


def _run(args: argparse.Namespace) -> int:
    from sluice.sim.run import run_from_args

    try:
        return run_from_args(args)
    except SluiceError as exc:
        print(f"sluice sim: error: {exc.message}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from sluice.sim.calibrate import calibrate_from_args

    if args.out is None:  # $SLUICE_HOME may not exist yet (no `sluice serve` has run here)
        env.home().mkdir(parents=True, exist_ok=True)
    try:
        return calibrate_from_args(args, args.out or default_profile_path())
    except SluiceError as exc:
        print(f"sluice sim calibrate: error: {exc.message}", file=sys.stderr)
        return 2
