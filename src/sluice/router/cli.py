"""`sluice router`: an OpenAI-compatible router in front of a pool of workers.

Workers come from `--worker URL` flags (one pool, model names discovered from the
workers' /v1/models unless `--model` names it), from a YAML/JSON `--config` file
(several pools), or at runtime from the admin API (`POST /admin/workers`).
It serves on its own HTTP/1.1 server (httptools, uvloop): see `router/server.py`.
"""

from __future__ import annotations

import argparse

from sluice import env
from sluice.observe.cli import add_observe_arguments, tracing_config
from sluice.observe.cli import buckets as observe_buckets
from sluice.observe.tracing import start_tracing
from sluice.router.config import (
    LONG,
    PoolConfig,
    RouterConfig,
    WorkerSpec,
    load_config_file,
    parse_kv_event_flags,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    from sluice.router.policies import POLICIES

    p = subparsers.add_parser("router", help="route OpenAI requests over a pool of workers",
                              description=__doc__,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker's base URL (repeat for more)")
    p.add_argument("--long-worker", action="append", default=[], metavar="URL",
                   help="a worker for prompts above --long-prompt-tokens (repeat for more)")
    p.add_argument("--worker-kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                   help="the ZMQ endpoint a worker publishes KV events on, "
                        "e.g. http://127.0.0.1:8001=tcp://127.0.0.1:5557")
    p.add_argument("--model", default=None,
                   help="model name of the --worker pool (default: what the workers serve)")
    p.add_argument("--alias", action="append", default=[], help="another name for the model")
    p.add_argument("--policy", default="cost", choices=sorted(POLICIES),
                   help="routing policy of the --worker pool")
    p.add_argument("--long-prompt-tokens", type=int, default=None,
                   help="prompts with more tokens go to the --long-worker group")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer (HF dir or .gguf) for prompt tokens; "
                        "default: ask a worker's /tokenize")
    p.add_argument("--block-size", type=int, default=16,
                   help="the workers' KV block size (prefix hashes must match the engine's)")
    p.add_argument("--config", default=None, help="YAML or JSON router config file")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    p.add_argument("--admin-key", default=None,
                   help="key required by /admin (default: $SLUICE_ROUTER_ADMIN_KEY; "
                        "without one /admin answers 403)")
    p.add_argument("--max-retries", type=int, default=None,
                   help="attempts on other workers before the first byte (default 2)")
    p.add_argument("--migration-limit", type=int, default=None,
                   help="times a stream whose worker fails mid-stream is resumed on another "
                        "worker, with the tokens so far (default 3; 0: off)")
    p.add_argument("--scrape-interval", type=float, default=None, dest="scrape_interval_s",
                   help="seconds between /metrics scrapes of each worker (default 0.5)")
    p.add_argument("--health-interval", type=float, default=None, dest="health_interval_s",
                   help="seconds between /health probes (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="seed of the tie-breaking RNG")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_observe_arguments(p)
    p.set_defaults(func=handler)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Flags over the config file: --worker flags add one pool."""
    base = load_config_file(args.config) if args.config else RouterConfig()
    pools = list(base.pools)
    if args.worker or args.long_worker:
        kv = parse_kv_event_flags(args.worker_kv_events)
        workers = [WorkerSpec(u, kv_events=kv.get(u.rstrip("/"))) for u in args.worker]
        workers += [WorkerSpec(u, kv_events=kv.get(u.rstrip("/")), group=LONG)
                    for u in args.long_worker]
        pools.append(PoolConfig(model=args.model, aliases=tuple(args.alias),
                                workers=tuple(workers), policy=args.policy,
                                long_prompt_tokens=args.long_prompt_tokens,
                                tokenizer=args.tokenizer, block_size=args.block_size))
    return base.with_overrides(
        pools=tuple(pools), host=args.host, port=args.port,
        admin_key=args.admin_key or env.get("ROUTER_ADMIN_KEY"), max_retries=args.max_retries,
        migration_limit=args.migration_limit, scrape_interval_s=args.scrape_interval_s, health_interval_s=args.health_interval_s,
        seed=args.seed)


def handler(args: argparse.Namespace) -> int:
    import logging

    from sluice.router.app import build_app
    from sluice.router.server import run

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe and scrape
    config = config_from_args(args)
    tracing = start_tracing(tracing_config(args, "sluice-router"))
    run(build_app(config, tracing=tracing, buckets=observe_buckets(args)),
        host=config.host, port=config.port)
    return 0
