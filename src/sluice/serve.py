"""`sluice serve`: the all-in-one a new user runs (for now: one worker on the default model).

The lead composes gateway + router + workers here later; today it is a worker with the
defaults of `sluice worker` and only the common flags.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from sluice.worker.cli import add_model_arguments

    p = subparsers.add_parser("serve", help="serve the default model on http://127.0.0.1:8000",
                              description=__doc__)
    add_model_arguments(p)
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"], help="(default: %(default)s)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from sluice.engine.config import EngineConfig
    from sluice.worker.config import WorkerConfig
    from sluice.worker.server import run_worker

    worker = WorkerConfig(host=args.host, port=args.port, log_level=args.log_level)
    return run_worker(EngineConfig.from_options(args.model), worker)
