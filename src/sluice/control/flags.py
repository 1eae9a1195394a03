"""The planner's scaling flags, declared once for `sluice serve`, `sluice sim` and the
autoscaling benchmarks, and read back into `PlannerConfig` keywords.

The configs check their own fields and name them (`scale_down_delay_s must be >= 0, got
-1`, param `scale_down_delay_s`), which is what an API user wrote; `named_by_flags` puts
the flag a command-line user typed in each field's place (`--scale-down-delay must be >=
0, got -1`, param `scale_down_delay`), from one table, `FLAGS`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from sluice.protocol.errors import InvalidRequestError

T = TypeVar("T")

FLAGS = {  # config field -> the flag that sets it (sluice serve, sluice sim)
    "min_replicas": "--min-workers", "max_replicas": "--max-workers",
    "scale_up_delay_s": "--scale-up-delay", "scale_down_delay_s": "--scale-down-delay",
    "scale_down_margin": "--scale-down-margin", "max_step_down": "--max-step-down",
    "lookahead_s": "--lookahead", "target_ongoing_requests": "--target-ongoing-requests",
    "target_kv_usage": "--target-kv-usage", "target_queue_length": "--target-queue-length",
    "scale_to_zero_after_s": "--scale-to-zero-after", "drain_grace_s": "--drain-timeout",
    "buffer_timeout_s": "--buffer-timeout", "slo": "--slo",
}


def named_by_flags(make: Callable[[], T], flags: Mapping[str, str] = FLAGS) -> T:
    """`make()` (a config's constructor), its field-named errors re-raised naming the
    flags (`flags`: field -> flag; the planner's by default)."""
    try:
        return make()
    except InvalidRequestError as exc:
        if exc.param is None or exc.param not in flags:
            raise
        field = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, flags)) + r")(?![\w-])")
        raise InvalidRequestError(field.sub(lambda m: flags[m[1]], exc.message),
                                  param=flags[exc.param][2:].replace("-", "_")) from exc


def add_scaling_arguments(g: argparse._ActionsContainer, min_help: str, max_help: str,
                          min_default: int | None = None) -> None:
    """--min-workers, --max-workers, --scale-up-delay, --scale-down-delay,
    --scale-down-margin, --max-step-down, --lookahead, --target-ongoing-requests and
    --target-kv-usage (the defaults are PlannerConfig's; the bounds' each command says)."""
    g.add_argument("--min-workers", type=int, default=min_default, help=min_help)
    g.add_argument("--max-workers", type=int, default=None, help=max_help)
    g.add_argument("--scale-up-delay", type=float, default=5.0,
                   help="seconds a larger count must be wanted before scaling up "
                        "(default: %(default)s)")
    g.add_argument("--scale-down-delay", type=float, default=60.0,
                   help="seconds a smaller count must be wanted before scaling down "
                        "(default: %(default)s)")
    g.add_argument("--scale-down-margin", type=float, default=0.6,
                   help="slo policy: a smaller count must meet the SLO with the load / this "
                        "(default: %(default)s)")
    g.add_argument("--max-step-down", type=int, default=None,
                   help="most workers removed per scale-down, toward the largest count "
                        "recommended over the scale-down delay (default: the max step, 1)")
    g.add_argument("--lookahead", type=float, default=30.0,
                   help="slo policy: also meet the SLO for the demand forecast this many "
                        "seconds ahead, about a new worker's start time; 0: today's only "
                        "(default: %(default)s)")
    g.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="queue policy: requests in flight or queued per worker to hold "
                        "(Ray Serve's name; default: %(default)s)")
    g.add_argument("--target-kv-usage", type=float, default=0.8,
                   help="kv policy: mean KV-cache usage to hold, 0..1 (llm-d's threshold; "
                        "default: %(default)s)")
    g.add_argument("--target-queue-length", type=float, default=5.0,
                   help="kv policy: requests waiting for prefill per worker to hold, the "
                        "policy's second metric (llm-d's queue threshold; default: "
                        "%(default)s)")


def scaling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The PlannerConfig keywords those flags set (bounds are the caller's: each checks
    them its own way)."""
    return {"scale_up_delay_s": args.scale_up_delay,
            "scale_down_delay_s": args.scale_down_delay,
            "scale_down_margin": args.scale_down_margin,
            "max_step_down": args.max_step_down,
            "lookahead_s": args.lookahead,
            "target_ongoing_requests": args.target_ongoing_requests,
            "target_kv_usage": args.target_kv_usage,
            "target_queue_length": args.target_queue_length}


def changed_scaling_options(args: argparse.Namespace) -> dict[str, Any]:
    """`scaling_options` set away from `PlannerConfig`'s defaults: the ones the user gave
    (their parser has defaults, so a given flag is told by its value)."""
    from dataclasses import fields

    from sluice.control.planner import PlannerConfig

    defaults = {f.name: f.default for f in fields(PlannerConfig)}
    return {name: value for name, value in scaling_options(args).items()
            if value != defaults[name]}


# The settings one planner policy reads and the others ignore (control/planner.py).
POLICY_ONLY = {"scale_down_margin": "slo", "lookahead_s": "slo",
               "target_ongoing_requests": "queue",
               "target_kv_usage": "kv", "target_queue_length": "kv"}


def check_policy_flags(policy: str, args: argparse.Namespace) -> None:
    """A flag set away from its default that only another policy reads is a 400 naming
    it (`--planner slo --target-kv-usage 0.5` ran and never read it)."""
    for name in changed_scaling_options(args):
        owner = POLICY_ONLY.get(name)
        if owner is not None and owner != policy:
            flag = FLAGS[name]
            raise InvalidRequestError(f"{flag} is read by the {owner} planner policy only, "
                                      f"not by {policy}", param=flag[2:].replace("-", "_"))
