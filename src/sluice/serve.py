"""`sluice serve`: the all-in-one entry point, gateway + router + workers on one machine.

    --workers 1 (default)                 --workers N, or --min-workers A --max-workers B
                                          (--pd P:D: P prefill and D decode workers)
    :8000  gateway ─▶ worker app          :8000  gateway ─▶ router ─▶ `sluice worker`s from
           (engine core in a child process)   (cost policy)   a backend (local processes
                                                 │            on free ports, or Ray actors),
                                                 planner      KV events over ZMQ

With a router, a controller in the router's process keeps the pool at the planner's
count: `--workers N` is a fixed N (a worker that dies is replaced); `--min-workers A
--max-workers B` scales between A and B on the SLO (`--slo ttft=2s,itl=200ms`), the
queue or KV usage; with A=0 the pool scales to zero after `--scale-to-zero-after`
seconds idle and the router holds requests (up to `--buffer-timeout`) until a worker
is ready. Decisions: `GET /admin/planner`, `sluice:desired_replicas` on /metrics.
`POST /admin/pools/{pool}/model {"model": PATH}` swaps the pool to another model
blue/green (new workers ready first, then traffic moves, then the old ones drain).

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
import math
import os
import sys
from typing import Any

from sluice import env
from sluice.control.flags import (
    add_scaling_arguments,
    check_policy_flags,
    named_by_flags,
    scaling_options,
)
from sluice.gateway.flags import add_gateway_arguments
from sluice.observe.cli import buckets as observe_buckets
from sluice.observe.cli import observe_flags, tracing_config
from sluice.protocol.edge import check_listen
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.prompt import TokenCache

SCALE_TO_ZERO_AFTER_S = 300.0  # --scale-to-zero-after's default with --min-workers 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from sluice.observe.cli import add_observe_arguments
    from sluice.router.cli import add_flow_arguments
    from sluice.worker.cli import add_chat_arguments, add_engine_arguments, add_model_arguments

    p = subparsers.add_parser("serve", help="serve the default model on http://127.0.0.1:8000",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--served-model-name", nargs=1, default=None, metavar="NAME",
                   help="the model id clients ask for, the router's pool and the planner's "
                        "pool label (default: derived from --model)")
    p.add_argument("--workers", type=int, default=None,
                   help="a fixed number of engine worker processes behind the router "
                        "(default: 1, one engine in this process, no router); not with "
                        "--min-workers/--max-workers")
    add_control_arguments(p)
    add_flow_arguments(p)
    p.add_argument("--policy", default="cost",
                   help="router policy with --workers > 1: cost, kv, prefix, session, "
                        "least_load, round_robin (default: %(default)s)")
    p.add_argument("--no-gateway", dest="gateway", action="store_false",
                   help="serve without API keys, limits or ledger")
    add_gateway_arguments(p)
    p.add_argument("--admin-key", default=None,
                   help="key for the gateway's and the router's /admin APIs (default: "
                        "SLUICE_ADMIN_KEY; without one they answer 403)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    add_engine_arguments(p)
    add_chat_arguments(p)
    add_observe_arguments(p)
    p.set_defaults(func=handler)


def add_control_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscaling (with a router)")
    g.add_argument("--backend", default="local", choices=["local", "ray", "external"],
                   help="where workers run; external: at --worker-url, placed by someone "
                        "else (Kubernetes): the planner only exports sluice:desired_replicas "
                        "(default: %(default)s)")
    g.add_argument("--worker-url", action="append", default=[], metavar="URL",
                   help="--backend external: a worker (or a Service in front of them)")
    g.add_argument("--worker-dns", action="append", default=[], metavar="URL",
                   help="--backend external: http://NAME:PORT, every address NAME resolves "
                        "to is a worker, re-resolved every 5 s (a Kubernetes headless "
                        "Service: one per ready pod; docs/router.md)")
    add_scaling_arguments(g, "autoscale: fewest workers; 0 scales to zero when idle",
                          "autoscale: most workers (default: --min-workers, at least 1)")
    g.add_argument("--slo", default="ttft=2s,itl=200ms",
                   help="targets of the slo planner policy: p90 TTFT and mean ITL "
                        "(default: %(default)s)")
    g.add_argument("--planner-policy", default="slo", choices=["slo", "queue", "kv"],
                   help="slo: fewest workers predicted to meet --slo; queue: requests per "
                        "worker; kv: KV-cache usage (default: %(default)s)")
    g.add_argument("--scale-to-zero-after", type=float, default=None,
                   help="with --min-workers 0: seconds idle before stopping the last worker "
                        f"(default: {SCALE_TO_ZERO_AFTER_S:g})")
    g.add_argument("--buffer-timeout", type=float, default=60.0,
                   help="seconds the router holds a request while no worker is ready, then "
                        "503 + Retry-After; 0 answers 503 at once (default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds a worker being scaled down may finish its streams "
                        "(default: %(default)s)")
    g.add_argument("--ray-address", default=None,
                   help="--backend ray: the cluster to join (default: start a local one)")
    g = p.add_argument_group("prefill/decode disaggregation (with a router)")
    g.add_argument("--pd", default=None, metavar="P:D",
                   help="a disaggregated pool: P prefill and D decode workers (e.g. --workers 4 "
                        "--pd 1:3; autoscaled pools keep the ratio); each worker gets --role")
    g.add_argument("--pd-mode", default=None, choices=["conditional", "always", "never"],
                   help="--pd: when a request is prefilled on a prefill worker "
                        "(default: conditional)")
    g.add_argument("--pd-min-uncached-tokens", type=int, default=None, metavar="N",
                   help="--pd conditional: uncached prompt tokens needed to prefill remotely "
                        "(default: 2048, the router's)")
    g.add_argument("--no-pd-rebalance", dest="pd_rebalance", action="store_false",
                   help="--pd: keep the P:D ratio (default: move workers between the sides by "
                        "switching their role live when one side is over its target)")


def worker_bounds(args: argparse.Namespace) -> tuple[int, int]:
    """(min, max) workers: `--workers N` for both, or --min-workers (default 1) and
    --max-workers (default: the min); errors name the flags given."""
    autoscaled = args.min_workers is not None or args.max_workers is not None
    if args.workers is not None and autoscaled:
        raise InvalidRequestError("--workers fixes the pool size: it cannot be combined with "
                                  "--min-workers/--max-workers", param="workers")
    if not autoscaled:
        n = 1 if args.workers is None else args.workers
        if n < 1:
            raise InvalidRequestError(f"--workers must be >= 1, got {n}", param="workers")
        return n, n
    if args.min_workers is not None and args.min_workers < 0:
        raise InvalidRequestError(f"--min-workers must be >= 0, got {args.min_workers}",
                                  param="min_workers")
    if args.max_workers is not None and args.max_workers < 1:
        raise InvalidRequestError(f"--max-workers must be >= 1, got {args.max_workers}",
                                  param="max_workers")
    lo = 1 if args.min_workers is None else args.min_workers
    hi = max(1, lo) if args.max_workers is None else args.max_workers
    if lo > hi:
        raise InvalidRequestError(f"--min-workers must be <= --max-workers ({hi}), got {lo}",
                                  param="min_workers")
    return lo, hi


def uses_router(args: argparse.Namespace) -> bool:
    return ((args.workers or 1) > 1 or args.min_workers is not None
            or args.max_workers is not None or args.backend != "local" or args.pd is not None)


def pd_ratio(args: argparse.Namespace) -> tuple[int, int] | None:
    """`--pd P:D` as (P, D); with a fixed pool P + D must be --workers. The other --pd
    flags without it are a 400 naming the first (they were taken and never read)."""
    if args.pd is None:
        given = [flag for flag, value in (("--pd-mode", args.pd_mode),
                                          ("--pd-min-uncached-tokens",
                                           args.pd_min_uncached_tokens))
                 if value is not None] + ([] if args.pd_rebalance else ["--no-pd-rebalance"])
        if given:
            raise InvalidRequestError(f"{given[0]} needs --pd P:D (a disaggregated pool)",
                                      param=given[0][2:].replace("-", "_"))
        return None
    p, sep, d = args.pd.partition(":")
    if not (sep and p.strip().isdigit() and d.strip().isdigit()) or int(p) < 1 or int(d) < 1:
        raise InvalidRequestError(f"--pd wants P:D with P, D >= 1 (e.g. 1:3), got {args.pd!r}",
                                  param="pd")
    ratio = int(p), int(d)
    lo, hi = worker_bounds(args)
    if lo == hi and sum(ratio) != hi:
        raise InvalidRequestError(f"--pd {args.pd} needs {sum(ratio)} workers, not {hi} "
                                  f"(--workers {sum(ratio)})", param="pd")
    return ratio


def say(message: str) -> None:
    print(f"sluice: {message}", file=sys.stderr, flush=True)



def gateway_wrap(args: argparse.Namespace, cache: TokenCache) -> Any:
    """A function wrapping an ASGI app in the gateway; prints the dev key on the way."""
    from sluice.engine.tokenizer import resolve_model
    from sluice.gateway.dev import ensure_dev_key
    from sluice.gateway.flags import gateway_config
    from sluice.gateway.middleware import GatewayMiddleware
    from sluice.gateway.state import GatewayState
    from sluice.gateway.tokens import PromptTokenCounter

    config = gateway_config(args)
    state = GatewayState.from_config(
        config, count_prompt_tokens=PromptTokenCounter(default_source=resolve_model(args.model),
                                                       cache=cache),
        buckets=observe_buckets(args))
    key = ensure_dev_key(state.store)
    say(f"API key for the dev tenant: {key}  (saved in {env.home() / 'dev-key'})" if key else
        "no dev key: the dev tenant was deleted; send a key of another tenant (sluice keys "
        "create --tenant NAME)")

    def wrap(app: Any) -> Any:
        return GatewayMiddleware(app, state)

    wrap.metrics = state.metrics.render  # type: ignore[attr-defined]  # for the status page
    return wrap


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The engine and chat flags given to `sluice serve`, as `sluice worker` arguments."""
    from sluice.worker.cli import ENGINE_FLAGS, ENGINE_SWITCHES

    flags = ["--model", args.model] if args.model else []
    flags += ["--tool-call-parser", args.tool_call_parser]
    if args.reasoning_parser:
        flags += ["--reasoning-parser", args.reasoning_parser]
    if args.chat_template:
        flags += ["--chat-template", os.path.abspath(args.chat_template)]
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
    from sluice.engine.generation_config import model_defaults
    from sluice.worker.cli import engine_config, read_chat_template
    from sluice.worker.config import WorkerConfig
    from sluice.worker.server import run_worker

    engine = engine_config(args)
    worker = WorkerConfig(host=args.host, port=args.port, log_level=args.log_level,
                          tool_call_parser=args.tool_call_parser,
                          reasoning_parser=args.reasoning_parser,
                          chat_template=read_chat_template(args.chat_template),
                          tracing=tracing_config(args, "sluice-serve"),
                          metrics_buckets=observe_buckets(args),
                          generation_defaults=model_defaults(engine.model))
    return run_worker(engine, worker, wrap=with_status(args, traced(args, wrap),
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


def planner_config(args: argparse.Namespace) -> Any:
    """The pool's `PlannerConfig`; errors name the flags (`control/flags.py`)."""
    from sluice.control.planner import SLO, PlannerConfig

    lo, hi = worker_bounds(args)
    after = args.scale_to_zero_after
    if after is not None and lo != 0:
        raise InvalidRequestError("--scale-to-zero-after needs --min-workers 0",
                                  param="scale_to_zero_after")
    if lo == 0 and after is None:
        after = SCALE_TO_ZERO_AFTER_S
    if lo == 0 and args.buffer_timeout == 0:  # the planner wakes a pool on requests held
        raise InvalidRequestError("--buffer-timeout 0 answers 503 at once and holds no "
                                  "request, so a pool at zero would never wake: with "
                                  "--min-workers 0 give it > 0", param="buffer_timeout")
    config = named_by_flags(lambda: PlannerConfig(
        policy=args.planner_policy, min_replicas=lo, max_replicas=hi, slo=SLO.parse(args.slo),
        **scaling_options(args), scale_to_zero_after_s=after))
    check_policy_flags(args.planner_policy, args)  # after the values' own checks
    return config


def controller_config(args: argparse.Namespace) -> Any:
    """The controller's settings; errors name the flags."""
    from sluice.control.controller import ControllerConfig

    return named_by_flags(lambda: ControllerConfig(drain_grace_s=args.drain_timeout))


def check_router_flags(args: argparse.Namespace) -> None:
    """`--buffer-timeout` as the router's config checks it (`RouterConfig`, which
    `serve_many` builds later), so a bad value stops `sluice serve` before anything starts;
    the error names the flag."""
    from sluice.router.config import RouterConfig

    named_by_flags(lambda: RouterConfig(buffer_timeout_s=args.buffer_timeout))


def backend_options(args: argparse.Namespace, flags: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {"worker_args": flags}
    if args.backend == "ray":
        options["address"] = args.ray_address
    return options


def local_cpu_threads(args: argparse.Namespace, max_workers: int) -> list[str]:
    """`--cpu-threads` for local workers: this machine's cores split between the most
    workers it runs at once, unless given (a CUDA engine ignores it). Engines that each
    start one OpenMP thread per core on shared cores stall at every parallel op's barrier
    waiting for a thread the other engine displaced: on a 2-core AMD EPYC (2026-12-02), two
    workers at 16 concurrent streams served 17 tokens/s with 2 threads each and 107 with 1
    (benchmarks/serve_threads.py, docs/worker.md)."""
    if args.backend != "local" or args.cpu_threads is not None:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return ["--cpu-threads", str(max(1, (cores or 1) // max(1, max_workers)))]


def pool_name(args: argparse.Namespace) -> str:
    """The model id the pool serves: the router's pool, the workers' served name and the
    planner's `pool` label are this one name."""
    from sluice.engine.tokenizer import default_served_name

    return (args.served_model_name or [default_served_name(args.model)])[0]


def serve_many(args: argparse.Namespace, wrap: Any, cache: TokenCache) -> int:
    from sluice.control.backend import ModelSpec, make_backend
    from sluice.control.controller import Controller, attach
    from sluice.control.pd import PDController
    from sluice.control.planner import PDRatioConfig, PDRatioPlanner, Planner
    from sluice.engine.tokenizer import resolve_model
    from sluice.observe.asgi import traced_gateway
    from sluice.observe.tracing import start_tracing
    from sluice.router.app import build_app, routed_first
    from sluice.router.cli import flow_overrides
    from sluice.router.config import PDConfig, PoolConfig, RouterConfig, WorkerSpec
    from sluice.router.server import run

    planning = planner_config(args)
    ratio = pd_ratio(args)
    name = pool_name(args)
    flags = (worker_flags(args) + ["--log-level", args.log_level, "--served-model-name", name]
             + observe_flags(args) + local_cpu_threads(args, planning.max_replicas))
    external = args.backend == "external"
    backend = None if external else named_by_flags(
        lambda: make_backend(args.backend, **backend_options(args, flags)),
        {"address": "--ray-address"})
    initial = max(1, planning.min_replicas)
    pool_config = PoolConfig(model=name, policy=args.policy, tokenizer=resolve_model(args.model),
                             block_size=args.block_size or 16,
                             workers=tuple(WorkerSpec(url) for url in args.worker_url),
                             discover=tuple(args.worker_dns),
                             pd=PDConfig(**{k: v for k, v in (
                                 ("mode", args.pd_mode),
                                 ("min_uncached_tokens", args.pd_min_uncached_tokens))
                                 if v is not None}) if ratio else None)
    config = flow_overrides(args, RouterConfig(
        pools=(pool_config,), host=args.host, port=args.port,
        admin_key=args.admin_key or env.get("ADMIN_KEY"), buffer_timeout_s=args.buffer_timeout))
    tracing = start_tracing(tracing_config(args, "sluice-serve"))
    app = build_app(config, token_cache=cache, tracing=tracing, buckets=observe_buckets(args),
                    status_metrics=[wrap.metrics] if wrap else [])
    wrap = traced_gateway(wrap, tracing) if wrap and tracing is not None else wrap
    control = controller_config(args)
    model = ModelSpec(resolve_model(args.model))  # a swap replaces it (POST .../model)

    made: list[Controller] = []

    def controllers(state: Any) -> list[Controller]:
        controller = Controller(name, state, state.pools[0], backend,
                                Planner(planning, initial=initial), control, model=model)
        made.append(controller)
        if ratio is not None:  # the P:D split, and live role switches (control/pd.py)
            rebalance = PDRatioPlanner(PDRatioConfig(delay_s=10.0 if args.pd_rebalance
                                                     else math.inf))
            controller.pd = PDController(name, state, state.pools[0], rebalance,
                                         prefill_share=ratio[0] / sum(ratio),
                                         drain_timeout_s=args.drain_timeout)
        return [controller]

    attach(app, controllers)
    show_control_logs(args.log_level)
    if backend is not None:
        say(f"starting {initial} of {planning.min_replicas}-{planning.max_replicas} workers on "
            f"{args.backend} (model load shows in their logs"
            + (f", in {backend.log_dir})" if hasattr(backend, "log_dir") else ")") + " ...")
    where = f"http://{args.host}:{args.port}" if args.port else f"a free port of {args.host}"
    say(f"router ({args.policy}) on {where}, listening once the first workers are ready; "
        "planner: GET /admin/planner")
    # the router's own server, the gateway (if any) a layer of it; the controller runs
    # in its lifespan (workers ready before it listens); SIGINT/SIGTERM drain, then the
    # workers stop and this exits 0
    try:
        run(wrap(routed_first(app)) if wrap else app, args.host, args.port,
            state=lambda: app.state.router, direct=wrap is None)
    except RuntimeError:  # the lifespan's startup failed: its cause, if it is the pool's
        failed = [c.initial_error for c in made if c.initial_error]
        if not failed:
            raise
        print(f"sluice serve: error: {failed[0]}", file=sys.stderr)
        silence_reported(failed[0])
        return 1
    say("stopped")
    return 0


def silence_reported(message: str) -> None:
    """Drop asyncio's 'Task exception was never retrieved' (a traceback, logged when the
    task is collected) for the error `message` already printed: the router server's
    lifespan task ends with the startup's exception and `router/server.py` does not
    retrieve it."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return exc is None or str(exc) != message

    logging.getLogger("asyncio").addFilter(keep)


def show_control_logs(level: str) -> None:
    """Scale events and planner decisions that change the count, and the router's one
    INFO line (`listening on http://HOST:PORT`, the real port under `--port 0`), go to
    stderr; the rest of the process (router, gateway) logs at `level`, as `sluice router`
    does."""
    import logging

    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe and scrape
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("sluice: %(message)s"))
    for name in ("sluice.control", "sluice.router.server"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(min(logging.INFO, logging.getLevelName(level.upper())))


def handler(args: argparse.Namespace) -> int:
    from sluice.protocol.errors import SluiceError

    try:
        planner_config(args)  # flag errors before anything starts (with a router or not)
        controller_config(args)
        check_router_flags(args)
        pd_ratio(args)  # the --pd flags without --pd, with a router or not
        if uses_router(args):
            if (args.backend == "external") != bool(args.worker_url or args.worker_dns):
                raise InvalidRequestError("--worker-url and --worker-dns go with --backend "
                                          "external (and --backend external needs one)",
                                          param="worker_url")
        if uses_router(args) and args.backend == "local":
            # its workers read the model's generation_config.json on this machine, and a
            # bad one stopped each of them (exit 2, started again): refused here first
            from sluice.engine.generation_config import generation_defaults
            generation_defaults(args.model, args.generation_config or "auto")
        check_listen(args.host, args.port)  # the flags first: they do not depend on the host
        cache = TokenCache()  # one per process: the gateway counts, the router hashes
        wrap = gateway_wrap(args, cache) if args.gateway else None
        if not uses_router(args):
            return serve_one(args, wrap)
        return serve_many(args, wrap, cache)
    except SluiceError as exc:
        print(f"sluice serve: error: {exc}", file=sys.stderr)
        return 2
