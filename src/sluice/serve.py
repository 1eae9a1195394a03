"""`sluice serve`: the all-in-one entry point, gateway + router + workers on one machine.

    --workers 1 (default)                 --workers N
    :8000  gateway ─▶ worker app          :8000  gateway ─▶ router ─▶ N `sluice worker`
           (engine core in a child process)   (cost policy)   processes on free ports,
                                                                  KV events over ZMQ

The prompt is tokenized once: the gateway counts it (one `TokenCache` per process,
shared with the router) and passes the ids on in `x-sluice-prompt-ids`; the router
hashes those ids, and the worker takes them when its tokenizer and text match.

The gateway authenticates every /v1 request. On first start it creates a `dev` tenant
and prints its key, saved in `SLUICE_HOME/dev-key` (default `./.sluice/dev-key`) and
reused on later starts, so the README's examples work as written. `--no-gateway` serves
without keys (the bare worker or router).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sluice import env
from sluice.observe.cli import buckets as observe_buckets
from sluice.observe.cli import observe_flags, tracing_config
from sluice.protocol.prompt import TokenCache


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from sluice.observe.cli import add_observe_arguments
    from sluice.worker.cli import add_engine_arguments, add_model_arguments

    p = subparsers.add_parser("serve", help="serve the default model on http://127.0.0.1:8000",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--workers", type=int, default=1,
                   help="engine worker processes behind the router (default: %(default)s: "
                        "one engine in this process, no router)")
    p.add_argument("--policy", default="cost",
                   help="router policy with --workers > 1: cost, kv, prefix, session, "
                        "least_load, round_robin (default: %(default)s)")
    p.add_argument("--no-gateway", dest="gateway", action="store_false",
                   help="serve without API keys, limits or ledger")
    p.add_argument("--database-url", default=None,
                   help="gateway store (default: SQLite at SLUICE_HOME/sluice.db; "
                        "postgresql://... for PostgreSQL)")
    p.add_argument("--redis-url", default=None,
                   help="shared limit counters across gateway replicas (default: in process)")
    p.add_argument("--admin-key", default=None,
                   help="key for the gateway's and the router's /admin APIs (default: "
                        "SLUICE_ADMIN_KEY; without one they answer 403)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    add_engine_arguments(p)
    add_observe_arguments(p)
    p.set_defaults(func=handler)


def say(message: str) -> None:
    print(f"sluice: {message}", file=sys.stderr, flush=True)


def gateway_wrap(args: argparse.Namespace, cache: TokenCache) -> Any:
    """A function wrapping an ASGI app in the gateway; prints the dev key on the way."""
    from sluice.engine.tokenizer import resolve_model
    from sluice.gateway.config import GatewayConfig, LimiterConfig
    from sluice.gateway.dev import ensure_dev_key
    from sluice.gateway.middleware import GatewayMiddleware
    from sluice.gateway.state import GatewayState
    from sluice.gateway.tokens import PromptTokenCounter

    config = GatewayConfig(
        database_url=args.database_url or env.get("DATABASE_URL"),
        admin_key=args.admin_key or env.get("ADMIN_KEY"),
        limiter=LimiterConfig(redis_url=args.redis_url or env.get("REDIS_URL")))
    state = GatewayState.from_config(
        config, count_prompt_tokens=PromptTokenCounter(default_source=resolve_model(args.model),
                                                       cache=cache))
    key = ensure_dev_key(state.store)
    say(f"API key for the dev tenant: {key}  (saved in {env.home() / 'dev-key'})")

    def wrap(app: Any) -> Any:
        return GatewayMiddleware(app, state)

    wrap.metrics = state.metrics.render  # type: ignore[attr-defined]  # for the status page
    return wrap


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags given to `sluice serve`, as `sluice worker` arguments."""
    from sluice.worker.cli import ENGINE_FLAGS, ENGINE_SWITCHES

    flags = ["--model", args.model] if args.model else []
    for dest in ENGINE_FLAGS:
        if getattr(args, dest, None) is not None:
            flags += ["--" + dest.replace("_", "-"), str(getattr(args, dest))]
    for dest in ENGINE_SWITCHES:
        value = getattr(args, dest, None)
        if value is not None:
            flags.append(("--" if value else "--no-") + dest.replace("_", "-"))
    return flags


def traced(args: argparse.Namespace, wrap: Any) -> Any:
    """The gateway wrap with the gateway's span around it, when tracing is on."""
    from sluice.observe.asgi import traced_gateway
    from sluice.observe.tracing import start_tracing

    tracing = start_tracing(tracing_config(args, "sluice-serve")) if wrap else None
    return traced_gateway(wrap, tracing) if tracing is not None else wrap


def serve_one(args: argparse.Namespace, wrap: Any) -> int:
    from sluice.worker.cli import engine_config
    from sluice.worker.config import WorkerConfig
    from sluice.worker.server import run_worker

    worker = WorkerConfig(host=args.host, port=args.port, log_level=args.log_level,
                          tracing=tracing_config(args, "sluice-serve"),
                          metrics_buckets=observe_buckets(args))
    return run_worker(engine_config(args), worker, wrap=with_status(args, traced(args, wrap),
                                                                getattr(wrap, "metrics", None)))


def with_status(args: argparse.Namespace, wrap: Any, local: Any) -> Any:
    """`/status` for one worker (no router to serve it): the worker's own registry is its
    row, the gateway's registry gives tenants."""
    from prometheus_client import generate_latest

    from sluice.observe.asgi import StatusRoutes
    from sluice.observe.status import StatusBoard

    def status(app: Any) -> Any:
        worker = app.state.worker
        url = f"http://{args.host}:{args.port}"

        async def fetch(_url: str) -> str:
            return generate_latest(worker.metrics.registry).decode()

        board = StatusBoard(lambda: [{"url": url, "healthy": worker.ready}], fetch,
                            lambda: [local().decode()] if local else [])
        board.open()
        return StatusRoutes(wrap(app) if wrap else app, board,
                            args.admin_key or env.get("ADMIN_KEY"))

    return status


def serve_many(args: argparse.Namespace, wrap: Any, cache: TokenCache) -> int:
    from sluice.control.local import LocalWorkerPool
    from sluice.engine.tokenizer import resolve_model
    from sluice.observe.asgi import traced_gateway
    from sluice.observe.tracing import start_tracing
    from sluice.router.app import build_app
    from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
    from sluice.router.server import run

    flags = worker_flags(args) + ["--log-level", args.log_level] + observe_flags(args)
    say(f"starting {args.workers} workers (model load shows in their logs) ...")
    with LocalWorkerPool(args.workers, flags, kv_events=True, host="127.0.0.1") as pool:
        say(f"workers ready: {', '.join(pool.urls)} (logs in {pool.log_dir})")
        workers = tuple(WorkerSpec(url, kv_events=kv)
                        for url, kv in zip(pool.urls, pool.kv_endpoints, strict=True))
        pool_config = PoolConfig(workers=workers, policy=args.policy,
                                 tokenizer=resolve_model(args.model),
                                 block_size=args.block_size or 16)
        config = RouterConfig(pools=(pool_config,), host=args.host, port=args.port,
                              admin_key=args.admin_key or env.get("ADMIN_KEY"))
        tracing = start_tracing(tracing_config(args, "sluice-serve"))
        app = build_app(config, token_cache=cache, tracing=tracing, buckets=observe_buckets(args),
                        status_metrics=[wrap.metrics] if wrap else [])
        wrap = traced_gateway(wrap, tracing) if wrap and tracing is not None else wrap
        say(f"router ({args.policy}) listening on http://{args.host}:{args.port}")
        # the router's own server, the gateway (if any) a layer of it; SIGINT/SIGTERM
        # drain, then the workers stop and this exits 0
        run(wrap(app) if wrap else app, args.host, args.port,
            state=lambda: app.state.router, direct=wrap is None)
    say("stopped")
    return 0


def handler(args: argparse.Namespace) -> int:
    from sluice.protocol.errors import SluiceError

    if args.workers < 1:
        print("sluice serve: error: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        cache = TokenCache()  # one per process: the gateway counts, the router hashes
        wrap = gateway_wrap(args, cache) if args.gateway else None
        return serve_one(args, wrap) if args.workers == 1 else serve_many(args, wrap, cache)
    except SluiceError as exc:
        print(f"sluice serve: error: {exc}", file=sys.stderr)
        return 2
