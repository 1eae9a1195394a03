"""`sluice bench serve`: drive OpenAI-compatible endpoints with a seeded workload.

The run, per endpoint (the first `--base-url`, then each `--compare` URL in turn):

    1. resolve the model (`--model`, or the first of `GET /v1/models`)
    2. warm up: `--warmup` random prompts (not the workload's, so no cache is primed)
    3. scrape `/metrics`            (counters before)
    4. dispatch the workload under the arrival process and concurrency cap; stream
    5. scrape `/metrics`            (counters after → prefix-cache hit rate, preemptions)
    6. summarize

then print the table, write `--json` / `--plot`, and print one JSON line last.
It talks HTTP only (httpx): no torch, no engine import.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from sluice.bench import report
from sluice.bench.client import ClientOptions, RequestRecord, StreamingClient, endpoint_kind
from sluice.bench.load import LoadConfig, check_burstiness, run_load, schedule
from sluice.bench.metrics import has_engine_counters, parse_slos, server_deltas, summarize
from sluice.bench.tokens import ServerTokenizer, TextEncoder, discover_vocab, open_tokenizer
from sluice.bench.workloads import (
    WORKLOADS,
    RandomWorkload,
    Session,
    ShareGPTWorkload,
    TraceWorkload,
    Workload,
    WorkloadConfig,
    build_workload,
)
from sluice.observe.prometheus import sum_samples
from sluice.protocol.errors import InvalidRequestError, SluiceError

DEFAULT_NUM_PROMPTS = 100
DEFAULT_NUM_SESSIONS = 8
DEFAULT_SHARED_PREFIX_LEN = 256
# CLI dest -> (WorkloadConfig field or None, flag), for the options a workload may read
WORKLOAD_OPTIONS: dict[str, tuple[str | None, str]] = {
    "input_len": ("input_len", "--input-len"),
    "output_len": ("output_len", "--output-len"),
    "range_ratio": ("range_ratio", "--random-range-ratio"),
    "length_dist": ("length_dist", "--length-dist"),
    "num_groups": ("num_groups", "--num-groups"),
    "system_prompt_len": ("system_prompt_len", "--system-prompt-len"),
    "num_turns": ("num_turns", "--num-turns"),
    "num_sessions": (None, "--num-sessions"),
    "trace_path": ("trace_path", "--trace"),
    "token_scale": ("token_scale", "--token-scale"),
    "output_token_scale": ("output_token_scale", "--output-token-scale"),
    "time_scale": ("time_scale", "--time-scale"),
    "dataset_path": ("dataset_path", "--dataset-path"),
}


@dataclass(frozen=True)
class ServeBenchConfig:
    base_urls: tuple[str, ...]
    endpoint: str
    model: str | None
    workload: str
    workload_cfg: WorkloadConfig
    load: LoadConfig
    num_sessions: int | None  # None: until --duration or the end of a finite workload
    uses_trace_times: bool
    warmup: int = 0
    tokenizer: str | None = None
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    session_header: bool = False
    slos: dict[str, float] = field(default_factory=dict)
    json_path: str | None = None
    plot_path: str | None = None
    request_timeout: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise InvalidRequestError("--warmup must be >= 0", param="warmup")
        if not 0 < self.request_timeout < math.inf:
            raise InvalidRequestError("--request-timeout must be > 0 and finite",
                                      param="request_timeout")
        if self.temperature is not None and not 0 <= self.temperature < math.inf:
            raise InvalidRequestError("--temperature must be >= 0 and finite", param="temperature")

    def describe(self) -> dict[str, Any]:
        used = {WORKLOAD_OPTIONS[k][0] for k in WORKLOADS[self.workload].uses} | {"seed"}
        if self.workload == "sharegpt":  # --output-len lands here; without it, each reply's
            used = (used - {"output_len"}) | {"sharegpt_output_len"}
        wl = {k: v for k, v in vars(self.workload_cfg).items() if k in used and v is not None}
        return {
            "endpoint": self.endpoint,
            "model": self.model,
            "workload": self.workload,
            "workload_options": wl,
            "num_sessions": self.num_sessions,
            "request_rate": self.load.request_rate,
            "burstiness": self.load.burstiness,
            "max_concurrency": self.load.max_concurrency,
            "duration": self.load.duration,
            "warmup": self.warmup,
            "seed": self.workload_cfg.seed,
            "ignore_eos": self.ignore_eos,
            "slos_ms": {k: v * 1000.0 for k, v in self.slos.items()},
        }


def check_base_url(url: str, flag: str) -> None:
    """A server's root, `http://HOST:PORT` (`--endpoint` adds `/v1/...`): the OpenAI
    SDK's `.../v1` would be asked for /v1/v1/models, a URL without a scheme for nothing."""
    try:
        parsed = httpx.URL(url) if "://" in url else None
    except httpx.InvalidURL:
        parsed = None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidRequestError(f"{flag} {url}: not an http(s)://HOST:PORT URL", param="base_url")
    if parsed.path.rstrip("/").endswith("/v1"):
        root = str(parsed.copy_with(path=parsed.path.rstrip("/")[:-3] or "/")).rstrip("/")
        raise InvalidRequestError(f"{flag} {url} ends in /v1: give the server's root ({root}); "
                                  "--endpoint adds /v1/completions or /v1/chat/completions",
                                  param="base_url")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """Validate the CLI options into a config; options a workload would ignore are errors."""
    spec = WORKLOADS[args.workload]
    given = {k for k in WORKLOAD_OPTIONS if getattr(args, k, None) is not None}
    unused = sorted(given - spec.uses)
    if unused:
        flags = ", ".join(WORKLOAD_OPTIONS[k][1] for k in unused)
        raise InvalidRequestError(f"--workload {args.workload} does not use {flags}", param=unused[0])
    wl: dict[str, Any] = {"seed": args.seed}
    for dest, (fld, _flag) in WORKLOAD_OPTIONS.items():
        if fld and getattr(args, dest, None) is not None:
            wl[fld] = getattr(args, dest)
    if args.workload == "sharegpt":
        wl["sharegpt_output_len"] = wl.pop("output_len", None)
    if args.workload == "shared-prefix":
        wl.setdefault("system_prompt_len", DEFAULT_SHARED_PREFIX_LEN)
    trace = args.workload == "trace"
    if trace and (args.request_rate is not None or args.burstiness is not None):
        raise InvalidRequestError("--workload trace replays its own timestamps; drop --request-rate/--burstiness", param="request_rate")
    check_burstiness(args.request_rate or math.inf, args.burstiness)
    load = LoadConfig(
        request_rate=math.inf if args.request_rate is None else args.request_rate,
        burstiness=1.0 if args.burstiness is None else args.burstiness,
        max_concurrency=args.max_concurrency,
        duration=args.duration,
        seed=args.seed,
    )
    count = _session_count(args, spec.finite)
    if count is None and math.isinf(load.request_rate) and not load.max_concurrency and not spec.finite:
        raise InvalidRequestError("--duration with --request-rate inf needs --max-concurrency", param="max_concurrency")
    endpoint_kind(args.endpoint)  # raises on an unknown endpoint
    check_base_url(args.base_url, "--base-url")
    for url in args.compare or []:
        check_base_url(url, "--compare")
    report.check_output(args.json, "--json")
    report.check_plot(args.plot)
    return ServeBenchConfig(
        base_urls=(args.base_url, *(args.compare or [])),
        endpoint=args.endpoint,
        model=args.model,
        workload=args.workload,
        workload_cfg=WorkloadConfig(**wl),
        load=load,
        num_sessions=count,
        uses_trace_times=trace,
        warmup=args.warmup,
        tokenizer=args.tokenizer,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        session_header=args.session_header,
        slos=parse_slos(args.slo),
        json_path=args.json,
        plot_path=args.plot,
        request_timeout=args.request_timeout,
        progress=not args.disable_tqdm,
    )


def _session_count(args: argparse.Namespace, finite: bool) -> int | None:
    if args.workload == "multi-turn":
        if args.num_prompts is not None:
            raise InvalidRequestError("multi-turn counts --num-sessions, not --num-prompts", param="num_prompts")
        if args.num_sessions is not None and args.num_sessions < 1:
            raise InvalidRequestError("--num-sessions must be >= 1", param="num_sessions")
        return args.num_sessions or (None if args.duration else DEFAULT_NUM_SESSIONS)
    if args.num_prompts is not None:
        if args.num_prompts < 1:
            raise InvalidRequestError("--num-prompts must be >= 1", param="num_prompts")
        return int(args.num_prompts)
    return None if (finite or args.duration) else DEFAULT_NUM_PROMPTS


# ---------------------------------------------------------------- one endpoint


def _http(cfg: ServeBenchConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=cfg.request_timeout, limits=limits, trust_env=False)


def _auth(cfg: ServeBenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def scrape(http: httpx.AsyncClient, base_url: str,
                 headers: dict[str, str]) -> dict[str, dict[str, float]] | None:
    """The server's `/metrics` samples, {base_url: samples}, or None when it exposes none.
    A sluice router (`sluice serve --workers N`) has no engine counters of its own: then
    each worker's that its `/status.json` lists, by the worker's URL (`server_deltas`
    sums their increases)."""
    counters = await _scrape_one(http, base_url, headers)
    if counters is None or not has_engine_counters(counters):
        scrapes = {url: s for url in await _status_workers(http, base_url, headers)
                   if (s := await _scrape_one(http, url, {})) is not None}
        if scrapes:
            return scrapes
    return {base_url: counters} if counters is not None else None


async def _scrape_one(http: httpx.AsyncClient, url: str, headers: dict[str, str]) -> dict[str, float] | None:
    try:
        resp = await http.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    return sum_samples(resp.text) if resp.status_code == 200 else None


async def _status_workers(http: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> list[str]:
    """The worker URLs a sluice router's `/status.json` lists (none from another server)."""
    try:
        resp = await http.get(base_url.rstrip("/") + "/status.json", headers=headers, timeout=10.0)
        workers = resp.json()["workers"] if resp.status_code == 200 else []
        return [str(w["url"]) for w in workers]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


def resolve_model(base_url: str, api_key: str | None) -> str:
    """The first model `GET /v1/models` lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        with httpx.Client(trust_env=False, timeout=10.0) as http:
            resp = http.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"cannot list models at {base_url} ({exc!r}); pass --model", param="model") from exc
    if resp.status_code in (401, 403):  # the request would be refused too: --model cannot help
        raise InvalidRequestError(f"GET {url} answered {resp.status_code} ({resp.text[:200]}); pass --api-key "
                                  "or set SLUICE_API_KEY", param="api_key")
    try:
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise InvalidRequestError(f"cannot list models at {base_url} ({exc!r}); pass --model", param="model") from exc


@dataclass
class EndpointRun:
    base_url: str
    records: list[RequestRecord]
    summary: dict[str, Any]


class _Progress:
    """tqdm on stderr, counting finished requests."""

    def __init__(self, total: int | None, desc: str, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not enabled)

    def __call__(self, _rec: RequestRecord) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def bench_endpoint(
    cfg: ServeBenchConfig, base_url: str, model: str, sessions: Iterator[Session],
    warmup: list[Session], total: int | None,
) -> EndpointRun:
    async with _http(cfg) as http:
        client = StreamingClient(http, ClientOptions(
            base_url, cfg.endpoint, model, cfg.api_key, cfg.ignore_eos, cfg.temperature, cfg.session_header,
        ))
        if warmup:
            warm = StreamingClient(http, replace(client.opts, request_id_prefix="warmup-"))
            await run_load(warm, ((s, 0.0) for s in warmup), replace(cfg.load, request_rate=math.inf, duration=None))
        before = await scrape(http, base_url, _auth(cfg))
        progress = _Progress(total, base_url, cfg.progress)
        try:
            result = await run_load(client, schedule(sessions, cfg.load, cfg.uses_trace_times), cfg.load, progress)
        finally:
            progress.close()
        after = await scrape(http, base_url, _auth(cfg))
    summary = {"base_url": base_url, "model": model, **summarize(result.records, result.duration, cfg.slos)}
    summary |= {f"server_{k}": v for k, v in server_deltas(before, after).items()}
    summary["started_at"] = result.started_at
    return EndpointRun(base_url, result.records, summary)


# ---------------------------------------------------------------- the whole run


def make_encoder(cfg: ServeBenchConfig, model: str, http: httpx.Client) -> TextEncoder:
    if cfg.tokenizer:
        return open_tokenizer(cfg.tokenizer)
    return ServerTokenizer(http, cfg.base_urls[0], model)


def _sessions(workload: Workload, count: int | None) -> Iterator[Session]:
    it = workload.sessions()
    return itertools.islice(it, count) if count is not None else it


def _total_requests(cfg: ServeBenchConfig, workload: Workload) -> int | None:
    """For the progress bar: known unless a duration or a filtered dataset decides."""
    count = cfg.num_sessions
    if count is None and cfg.load.duration is None and isinstance(workload, TraceWorkload):
        count = len(workload.rows)
    if count is None:
        return None
    return count * (cfg.workload_cfg.num_turns if cfg.workload == "multi-turn" else 1)


def run_benchmark(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run every endpoint in turn with the same workload; return the JSON document."""
    model = cfg.model or resolve_model(cfg.base_urls[0], cfg.api_key)
    with httpx.Client(trust_env=False, timeout=30.0, headers=_auth(cfg)) as http:
        encoder = make_encoder(cfg, model, http)
        vocab = discover_vocab(encoder)
        workload = build_workload(cfg.workload, cfg.workload_cfg, vocab, encoder)
        total = _total_requests(cfg, workload)
        # a dataset's texts are counted by the encoder (the server's /tokenize): all of
        # them now, while its client is open and before any clock starts
        counted = (list(_sessions(workload, cfg.num_sessions))
                   if isinstance(workload, ShareGPTWorkload) else None)
    if counted is not None and cfg.load.duration is None:
        total = len(counted)

    def sessions() -> Iterator[Session]:
        return iter(counted) if counted is not None else _sessions(workload, cfg.num_sessions)

    wc = cfg.workload_cfg
    warm_cfg = replace(wc, seed=wc.seed + 1_000_003, output_len=min(wc.output_len, 16))
    warmup = list(itertools.islice(RandomWorkload(warm_cfg, vocab).sessions(), cfg.warmup))
    runs = [
        asyncio.run(bench_endpoint(cfg, url, model, sessions(), warmup, total))
        for url in cfg.base_urls
    ]
    results = [
        r.summary | {"requests": [x.to_dict() for x in r.records],
                     "throughput_over_time": report.throughput_over_time(r.records)}
        for r in runs
    ]
    doc: dict[str, Any] = {"benchmark": "serve", "config": cfg.describe() | {"model": model}, "results": results}
    if len(results) > 1:
        doc["ratios"] = [
            {"base_url": r["base_url"], **rat} for r, rat in zip(results[1:], report.ratios(results), strict=True)
        ]
    if cfg.plot_path:
        report.plot(cfg.plot_path, [(r.base_url, r.records) for r in runs])
    return doc


def run(args: argparse.Namespace) -> int:
    """CLI handler: table on stdout, `--json`, `--plot`, then one JSON line last."""
    try:
        cfg = config_from_args(args)
        doc = run_benchmark(cfg)
    except SluiceError as exc:
        print(f"sluice bench serve: error: {exc.message}", file=sys.stderr)
        return 2
    print(report.table(doc["results"]))
    if cfg.json_path:
        report.write_json(cfg.json_path, doc)
    print(report.summary_line(doc), flush=True)
    return 0 if all(r["completed"] for r in doc["results"]) else 1
