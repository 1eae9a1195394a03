"""`sluice router`: an OpenAI-compatible router in front of a pool of workers.

Workers come from `--worker URL` flags (one pool, model names discovered from the
workers' /v1/models unless `--model` names it), from a YAML/JSON `--config` file
(several pools), or at runtime from the admin API (`POST /admin/workers`).
`--canary-worker` and `--shadow-worker` add a canary and a shadow to the `--worker`
pool (docs/router.md, Releases). `--prefill-worker` and `--decode-worker` make it a
disaggregated pool (prefill on one worker, KV handed to a decode worker: router/pd.py).
It serves on its own HTTP/1.1 server (httptools, uvloop): see `router/server.py`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from sluice import env
from sluice.observe.cli import add_observe_arguments, tracing_config
from sluice.observe.cli import buckets as observe_buckets
from sluice.observe.tracing import start_tracing
from sluice.protocol.edge import check_listen
from sluice.protocol.errors import InvalidRequestError, SluiceError
from sluice.router.config import (
    CANARY,
    DECODE,
    LONG,
    PD_MODES,
    PREFILL,
    SHADOW,
    AdapterSpec,
    PDConfig,
    PoolConfig,
    ReleaseConfig,
    RouterConfig,
    WorkerSpec,
    load_config_file,
    parse_alias_flags,
    parse_kv_event_flags,
    parse_tenant_pins,
)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's `(default: X)` after each flag's help, but where the help names its own
    default, or the flag's is None (its default lives in RouterConfig, so that a config
    file's value stands) or empty, or the flag is a switch: `--host` read "(default
    127.0.0.1) (default: None)", `--no-canary-auto` "(default: True)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default == [] \
                or isinstance(action, argparse._StoreConstAction):  # an on/off flag
            return text
        return super()._get_help_string(action)


def register(subparsers: argparse._SubParsersAction) -> None:
    from sluice.router.policies import POLICIES

    p = subparsers.add_parser("router", help="route OpenAI requests over a pool of workers",
                              description=__doc__, formatter_class=_Help)
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker's base URL (repeat for more)")
    p.add_argument("--worker-dns", action="append", default=[], metavar="URL",
                   help="http://NAME:PORT: every address NAME resolves to is a worker on "
                        "PORT, re-resolved every 5 s (a Kubernetes headless Service: one "
                        "per ready pod; docs/router.md#workers-found-by-dns)")
    p.add_argument("--long-worker", action="append", default=[], metavar="URL",
                   help="a worker for prompts above --long-prompt-tokens (repeat for more)")
    p.add_argument("--worker-kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                   help="the ZMQ endpoint a worker publishes KV events on, "
                        "e.g. http://127.0.0.1:8001=tcp://127.0.0.1:5557")
    p.add_argument("--model", default=None,
                   help="model name of the --worker pool (default: what the workers serve)")
    p.add_argument("--alias", action="append", default=[], metavar="NAME[=TARGET]",
                   help="another name for the model; NAME=TARGET: a router-wide alias of "
                        "TARGET (a model, an adapter)")
    p.add_argument("--lora-adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a LoRA adapter the router loads on workers on demand")
    p.add_argument("--max-adapter-replicas", type=int, default=None, metavar="N",
                   help="workers one adapter may be loaded on (default 2)")
    p.add_argument("--policy", default="cost", choices=sorted(POLICIES),
                   help="routing policy of the --worker pool")
    p.add_argument("--long-prompt-tokens", type=int, default=None,
                   help="prompts with more tokens go to the --long-worker group")
    p.add_argument("--tokenizer", default=None,
                   help="local tokenizer (HF dir or .gguf) for prompt tokens; "
                        "default: ask a worker's /tokenize")
    p.add_argument("--block-size", type=int, default=16,
                   help="the workers' KV block size (prefix hashes must match the engine's)")
    add_release_arguments(p)
    add_pd_arguments(p)
    p.add_argument("--config", default=None, help="YAML or JSON router config file")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    p.add_argument("--admin-key", default=None,
                   help="key required by /admin (default: $SLUICE_ROUTER_ADMIN_KEY; "
                        "without one /admin answers 403)")
    p.add_argument("--max-retries", type=int, default=None,
                   help="attempts on other workers before the first byte (default 2)")
    p.add_argument("--scrape-interval", type=float, default=None, dest="scrape_interval_s",
                   help="seconds between /metrics scrapes of each worker (default 0.5)")
    p.add_argument("--health-interval", type=float, default=None, dest="health_interval_s",
                   help="seconds between /health probes (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="seed of the tie-breaking RNG (default: random)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_flow_arguments(p)
    add_observe_arguments(p)
    p.set_defaults(func=handler)


def add_flow_arguments(p: argparse.ArgumentParser) -> None:
    """Admission queue, circuit breaker and migration flags (`sluice router` and `sluice serve`);
    unset flags keep the config file's value, else the default shown."""
    g = p.add_argument_group("flow control (docs/router.md#flow-control)")
    g.add_argument("--max-inflight-per-worker", type=int, default=None, metavar="N",
                   help="requests in flight per worker before new ones wait in the router's "
                        "admission queue; 0: no limit (default 256)")
    g.add_argument("--max-predicted-wait", type=float, default=None, metavar="SECONDS",
                   dest="max_predicted_wait_s",
                   help="seconds of predicted queueing on a worker before new requests wait "
                        "in the router instead; 0: off (default 0)")
    g.add_argument("--queue-capacity", type=int, default=None, metavar="N",
                   help="requests that may wait per priority band; more: 429 (default 1000)")
    g.add_argument("--queue-timeout", type=float, default=None, metavar="SECONDS", dest="queue_timeout_s",
                   help="seconds a request may wait in the admission queue, then 503 "
                        "(default 60)")
    g.add_argument("--tenant-weight", action="append", default=[], metavar="TENANT=WEIGHT",
                   help="a tenant's share within its priority band (default 1 each; repeat)")
    g.add_argument("--breaker-failures", type=int, default=None, metavar="N",
                   help="consecutive request failures that open a worker's circuit breaker; "
                        "0: no breakers (failures count toward ejection) (default 5)")
    g.add_argument("--breaker-open", type=float, default=None, metavar="SECONDS", dest="breaker_open_s",
                   help="seconds a breaker stays open before trial requests (default 30)")
    g.add_argument("--migration-limit", type=int, default=None, metavar="N",
                   help="times a stream whose worker fails mid-stream is resumed on another "
                        "worker, with the tokens so far; 0: off (default 3)")
    g.add_argument("--stalled-stream-timeout", type=float, default=None, metavar="SECONDS",
                   dest="stalled_stream_timeout_s",
                   help="on a worker ejected because its health probes time out (frozen, "
                        "hung, partitioned), requests that have received nothing for this "
                        "long are cut: streams migrate, the others are retried elsewhere "
                        "(default 10)")
    g.add_argument("--retry-budget", type=float, default=None, metavar="RATIO",
                   help="retries allowed as a fraction of the pool's requests over 10 s, "
                        "plus 10 (default 0.2)")


def _tenant_weights(items: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        tenant, sep, weight = item.rpartition("=")
        try:
            out[tenant] = float(weight)
        except ValueError:
            sep = ""
        if not sep or not tenant:
            raise InvalidRequestError(f"--tenant-weight wants TENANT=WEIGHT, got {item!r}",
                                      param="tenant-weight")
    return out


def flow_overrides(args: argparse.Namespace, config: RouterConfig) -> RouterConfig:
    """`config` with the flow-control flags that were given applied."""
    admission, breaker = config.admission, config.breaker
    band = {k: v for k, v in (("capacity", args.queue_capacity),
                              ("timeout_s", args.queue_timeout_s)) if v is not None}
    changes = {k: v for k, v in (("max_inflight_per_worker", args.max_inflight_per_worker),
                                 ("max_predicted_wait_s", args.max_predicted_wait_s)) if v is not None}
    if band:
        changes["default_band"] = replace(admission.default_band, **band)
    if args.tenant_weight:
        changes["tenant_weights"] = {**admission.tenant_weights,
                                     **_tenant_weights(args.tenant_weight)}
    breaks = {k: v for k, v in (("failures", args.breaker_failures),
                                ("open_s", args.breaker_open_s),
                                ("budget_ratio", args.retry_budget)) if v is not None}
    streams = {k: v for k, v in (("migration_limit", args.migration_limit),
                                 ("stalled_stream_timeout_s", args.stalled_stream_timeout_s))
               if v is not None}
    return replace(config, admission=replace(admission, **changes),
                   breaker=replace(breaker, **breaks), **streams)


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    defaults = PDConfig()
    g = p.add_argument_group("prefill/decode disaggregation of the --worker pool "
                             "(docs/router.md#prefilldecode-disaggregation)")
    g.add_argument("--prefill-worker", action="append", default=[], metavar="URL",
                   help="a prefill worker (repeat for more); makes the pool disaggregated")
    g.add_argument("--decode-worker", action="append", default=[], metavar="URL",
                   help="a decode worker (repeat for more); makes the pool disaggregated")
    g.add_argument("--pd-mode", default=None, choices=PD_MODES,
                   help="conditional: prefill remotely when --pd-min-uncached-tokens and the "
                        "prefill side's predicted wait allow; always; never (default "
                        "conditional; given alone, the --worker pool is disaggregated with the "
                        "roles its workers report on GET /v1/pd_role)")
    g.add_argument("--pd-min-uncached-tokens", type=int, default=defaults.min_uncached_tokens,
                   metavar="N", help="conditional: prompt tokens not cached on the decode "
                                     "worker needed to prefill remotely")
    g.add_argument("--pd-max-prefill-wait-ratio", type=float,
                   default=defaults.max_prefill_wait_ratio, metavar="R",
                   help="conditional: prefill remotely only while the prefill worker's "
                        "predicted queueing is at most R x the local prefill's predicted time")


def pd_from_args(args: argparse.Namespace) -> PDConfig | None:
    """The --worker pool's P/D settings; the conditional mode's tuning flags without a
    disaggregated pool are a 400 naming the first (they were taken and never read)."""
    if not (args.prefill_worker or args.decode_worker or args.pd_mode):
        defaults = PDConfig()
        for flag, value, default in (
                ("--pd-min-uncached-tokens", args.pd_min_uncached_tokens,
                 defaults.min_uncached_tokens),
                ("--pd-max-prefill-wait-ratio", args.pd_max_prefill_wait_ratio,
                 defaults.max_prefill_wait_ratio)):
            if value != default:
                raise InvalidRequestError(f"{flag} needs a disaggregated pool (--pd-mode, "
                                          "--prefill-worker or --decode-worker)",
                                          param=flag[2:].replace("-", "_"))
        return None
    return PDConfig(mode=args.pd_mode or "conditional",
                    min_uncached_tokens=args.pd_min_uncached_tokens,
                    max_prefill_wait_ratio=args.pd_max_prefill_wait_ratio)


def add_release_arguments(p: argparse.ArgumentParser) -> None:
    defaults = ReleaseConfig()
    g = p.add_argument_group("releases (canary, pins, shadow) of the --worker pool")
    g.add_argument("--canary-worker", action="append", default=[], metavar="URL",
                   help="a worker of the canary version (repeat for more)")
    g.add_argument("--canary-weight", type=float, default=defaults.canary_weight,
                   metavar="PCT", help="percent of requests to the canary at start "
                                       "(0: none until started by the admin API)")
    g.add_argument("--canary-steps", default=",".join(f"{s:g}" for s in defaults.steps),
                   metavar="PCTS", help="weights automatic promotion steps through")
    g.add_argument("--canary-window", type=float, default=defaults.window_s, metavar="S",
                   help="seconds of samples compared, and spent healthy at a step before "
                        "the next")
    g.add_argument("--canary-min-samples", type=int, default=defaults.min_samples,
                   metavar="N", help="samples each version needs before a metric is judged")
    g.add_argument("--canary-alpha", type=float, default=defaults.alpha, metavar="A",
                   help="significance level of the one-sided tests")
    g.add_argument("--no-canary-auto", action="store_false", dest="canary_auto",
                   help="never roll back or promote by itself (only by hand)")
    g.add_argument("--pin-tenant", action="append", default=[], metavar="TENANT=VERSION",
                   help="send a tenant's requests to baseline or canary (TENANT: the id "
                        "the gateway sends in x-sluice-tenant)")
    g.add_argument("--shadow-worker", action="append", default=[], metavar="URL",
                   help="a worker that gets copies of requests, answers discarded")
    g.add_argument("--shadow-percent", type=float, default=defaults.shadow_percent,
                   metavar="PCT", help="percent of requests copied to the shadow workers")
    g.add_argument("--shadow-max-concurrency", type=int,
                   default=defaults.shadow_max_concurrency, metavar="N",
                   help="copies in flight at most; more are dropped (counted)")


def release_from_args(args: argparse.Namespace) -> ReleaseConfig:
    try:
        steps = tuple(float(s) for s in args.canary_steps.split(",") if s.strip())
    except ValueError as exc:
        raise InvalidRequestError(f"--canary-steps wants percentages like 5,25,50,100, got "
                                  f"{args.canary_steps!r}", param="canary-steps") from exc
    return ReleaseConfig(canary_weight=args.canary_weight, steps=steps, auto=args.canary_auto,
                         window_s=args.canary_window, min_samples=args.canary_min_samples,
                         alpha=args.canary_alpha, pin_tenants=parse_tenant_pins(args.pin_tenant),
                         shadow_percent=args.shadow_percent,
                         shadow_max_concurrency=args.shadow_max_concurrency)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Flags over the config file: --worker flags add one pool."""
    base = load_config_file(args.config) if args.config else RouterConfig()
    pools = list(base.pools)
    if args.worker or args.worker_dns or args.long_worker or args.canary_worker \
            or args.shadow_worker or args.prefill_worker or args.decode_worker:
        kv = parse_kv_event_flags(args.worker_kv_events)
        workers = [WorkerSpec(u, kv_events=kv.get(u.rstrip("/"))) for u in args.worker]
        workers += [WorkerSpec(u, kv_events=kv.get(u.rstrip("/")), role=role)
                    for role, urls in ((PREFILL, args.prefill_worker),
                                       (DECODE, args.decode_worker)) for u in urls]
        workers += [WorkerSpec(u, kv_events=kv.get(u.rstrip("/")), group=LONG)
                    for u in args.long_worker]
        workers += [WorkerSpec(u, kv_events=kv.get(u.rstrip("/")), version=CANARY)
                    for u in args.canary_worker]
        workers += [WorkerSpec(u, version=SHADOW) for u in args.shadow_worker]
        unknown = sorted(set(kv) - {w.url for w in workers})
        if unknown:  # a typo'd URL: its events were never read
            raise InvalidRequestError(f"--worker-kv-events names no worker: {unknown[0]}",
                                      param="worker-kv-events")
        pools.append(PoolConfig(model=args.model,
                                aliases=tuple(a for a in args.alias if "=" not in a),
                                workers=tuple(workers), discover=tuple(args.worker_dns),
                                policy=args.policy,
                                long_prompt_tokens=args.long_prompt_tokens,
                                tokenizer=args.tokenizer, block_size=args.block_size,
                                release=release_from_args(args), pd=pd_from_args(args)))
    base = adapter_overrides(args, base)
    return flow_overrides(args, base.with_overrides(
        pools=tuple(pools), host=args.host, port=args.port,
        admin_key=args.admin_key or env.get("ROUTER_ADMIN_KEY"), max_retries=args.max_retries,
        scrape_interval_s=args.scrape_interval_s, health_interval_s=args.health_interval_s,
        seed=args.seed))


def adapter_overrides(args: argparse.Namespace, config: RouterConfig) -> RouterConfig:
    """`config` with `--alias NAME=TARGET`, `--lora-adapter` and `--max-adapter-replicas`."""
    adapters = [*config.adapters]
    for item in args.lora_adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"--lora-adapter wants NAME=PATH, got {item!r}",
                                      param="lora-adapter")
        adapters.append(AdapterSpec(name, path))
    placement = config.adapter_placement
    if args.max_adapter_replicas is not None:
        placement = replace(placement, max_adapter_replicas=args.max_adapter_replicas)
    return replace(config, adapters=tuple(adapters), adapter_placement=placement,
                   aliases=(*config.aliases, *parse_alias_flags(args.alias)))


def handler(args: argparse.Namespace) -> int:
    import logging

    from sluice.router.app import build_app, load_tokenizers
    from sluice.router.server import run

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per probe and scrape
    try:  # every setting checked before anything starts (--metrics-buckets, --tokenizer
        # and --otlp-traces-endpoint were read after this and ended in a traceback)
        config = config_from_args(args)
        buckets = observe_buckets(args)
        tokenizers = load_tokenizers(config)
        check_listen(config.host, config.port)  # a busy port: as serve and worker say it
        tracing = start_tracing(tracing_config(args, "sluice-router"))
    except SluiceError as exc:  # a bad flag or config file: a usage error, as argparse's
        print(f"sluice router: error: {exc}", file=sys.stderr)
        return 2
    try:
        run(build_app(config, tracing=tracing, buckets=buckets, local_tokenizers=tokenizers),
            host=config.host, port=config.port)
    except OSError as exc:  # the address is taken, or not this machine's
        print(f"sluice router: error: {exc}", file=sys.stderr)
        return 1
    return 0
