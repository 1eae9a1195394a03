"""Soak: steady streaming load through `sluice serve` for minutes, watching every sluice
process's memory (RSS) and open file descriptors for leaks.

    client (N streaming loops, the dev key) ─▶ sluice serve --workers 2 (gateway + router)
                                                   ├─▶ sluice worker ─▶ engine core
                                                   └─▶ sluice worker ─▶ engine core
    sampler: every --sample-s seconds, RSS and fd count of the serve process and all its
             descendants (read from /proc), written to soak.csv

A process is "flat" when, after the warm-up, every sample stays within --tolerance
(10%) of its first post-warm-up sample (fds: within 10% or 8 descriptors, whichever is
larger, since a handful of sockets come and go with the load). Also reported: the
least-squares slope per hour (MiB/h, fds/h) so a slow leak shows even inside 10%.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/soak.py                # 30 min, default model
    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/soak.py --minutes 5 --warmup-minutes 1
    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/soak.py --stub --minutes 2   # fast variant

`--stub`: `sluice serve --backend external` (gateway + router) in front of a stub worker
(this file run with `--stub-worker PORT`: /health, /metrics, /v1/models and a streamed
chat completion), so the gateway and router are soaked at a far higher request rate;
the engine is not. Writes soak.csv and soak.png into --out; prints a table; the last
stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sluice.control.local import free_port

# -- the processes ---------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    pid: int
    role: str
    rss_mib: float
    fds: int


def children_of() -> dict[int, list[int]]:
    """{parent pid: child pids} for every process on the machine (from /proc/*/stat)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def descendants(root: int) -> list[int]:
    tree, out, todo = children_of(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def role_of(pid: int) -> str:
    """A short label from the command line: serve, worker:PORT, engine-core, ..."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    words = [a.decode(errors="replace") for a in argv if a]
    if "serve" in words:
        return "serve"
    if "worker" in words and "--port" in words:
        return "worker:" + words[words.index("--port") + 1]
    if any("resource_tracker" in w for w in words):
        return "mp-resource-tracker"
    if any("multiprocessing" in w or "spawn_main" in w for w in words):
        return "engine-core"
    return Path(words[0]).name if words else "?"


def sample(root: int, t: float) -> list[Sample]:
    out = []
    for pid in descendants(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue  # exited between the listing and the read
        rss_kib = next(int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmRSS:"))
        out.append(Sample(t, pid, role_of(pid), rss_kib / 1024, fds))
    return out


# -- load ------------------------------------------------------------------------------------


@dataclass
class LoadStats:
    ok: int = 0
    errors: int = 0
    tokens: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


async def stream_loop(client: httpx.AsyncClient, model: str, max_tokens: int, seed: int,
                      stop: asyncio.Event, stats: LoadStats) -> None:
    """One client: streamed chat requests back to back (prompts vary by seed and count)."""
    n = 0
    while not stop.is_set():
        n += 1
        body = {"model": model, "max_tokens": max_tokens, "stream": True,
                "messages": [{"role": "user", "content": f"Story {seed}-{n}: tell me about "
                                                         f"rivers number {n % 17}."}]}
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    stats.tokens += line.startswith("data: {")
            stats.ok += 1
        except (httpx.HTTPError, RuntimeError) as exc:
            kind = str(exc)[:40] or type(exc).__name__
            stats.errors += 1
            stats.error_kinds[kind] = stats.error_kinds.get(kind, 0) + 1
            await asyncio.sleep(0.5)


async def soak(url: str, key: str, model: str, root: int, args: argparse.Namespace,
               writer: Any) -> tuple[list[Sample], LoadStats]:
    stop, stats = asyncio.Event(), LoadStats()
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits,
                                 headers={"authorization": f"Bearer {key}"}) as client:
        loops = [asyncio.create_task(stream_loop(client, model, args.max_tokens, i, stop, stats))
                 for i in range(args.concurrency)]
        started = time.monotonic()
        end = started + args.minutes * 60
        while True:
            t = time.monotonic() - started
            now = sample(root, round(t, 1))
            samples += now
            for s in now:
                writer.writerow([s.t, s.pid, s.role, f"{s.rss_mib:.1f}", s.fds])
            print(f"t={t:6.0f}s ok={stats.ok} errors={stats.errors} "
                  + " ".join(f"{s.role}:{s.rss_mib:.0f}MiB/{s.fds}fd" for s in now),
                  file=sys.stderr, flush=True)
            if time.monotonic() >= end:
                break
            await asyncio.sleep(min(args.sample_s, max(0.0, end - time.monotonic())))
        stop.set()
        await asyncio.gather(*loops, return_exceptions=True)
    return samples, stats


# -- verdict ---------------------------------------------------------------------------------


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 3600


def verdict(samples: list[Sample], warmup_s: float, tolerance: float) -> list[dict[str, Any]]:
    """Per process (pid): first and last post-warm-up RSS and fds, worst deviation, slope."""
    rows = []
    for pid in sorted({s.pid for s in samples}):
        mine = [s for s in samples if s.pid == pid and s.t >= warmup_s]
        if len(mine) < 2:
            continue
        base = mine[0]
        rss_dev = max(abs(s.rss_mib - base.rss_mib) for s in mine) / base.rss_mib
        fd_dev = max(abs(s.fds - base.fds) for s in mine)
        fd_allowed = max(tolerance * base.fds, 8)
        rows.append({
            "pid": pid, "role": base.role, "samples": len(mine),
            "rss_mib_first": round(base.rss_mib, 1), "rss_mib_last": round(mine[-1].rss_mib, 1),
            "rss_max_deviation": round(rss_dev, 4),
            "rss_mib_per_hour": round(slope_per_hour([(s.t, s.rss_mib) for s in mine]), 1),
            "fds_first": base.fds, "fds_last": mine[-1].fds, "fds_max_deviation": fd_dev,
            "fds_per_hour": round(slope_per_hour([(s.t, float(s.fds)) for s in mine]), 1),
            "flat": rss_dev <= tolerance and fd_dev <= fd_allowed,
        })
    return rows


def plot(path: Path, samples: list[Sample], warmup_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for pid in sorted({s.pid for s in samples}):
        mine = [s for s in samples if s.pid == pid]
        label = f"{mine[0].role} ({pid})"
        base = next((s.rss_mib for s in mine if s.t >= warmup_s), mine[0].rss_mib)
        top.plot([s.t / 60 for s in mine], [s.rss_mib for s in mine], label=label)
        middle.plot([s.t / 60 for s in mine], [100 * (s.rss_mib / base - 1) for s in mine],
                    label=label)
        bottom.plot([s.t / 60 for s in mine], [s.fds for s in mine], label=label)
    top.set_yscale("log")
    for ax, what in ((top, "RSS (MiB, log)"), (middle, "RSS change since warm-up (%)"),
                     (bottom, "open fds")):
        ax.axvline(warmup_s / 60, color="grey", linestyle=":", label="end of warm-up")
        ax.set(ylabel=what)
        ax.grid(alpha=0.3)
    top.legend(fontsize=7)
    bottom.set(xlabel="minutes")
    top.set_title("sluice serve under steady streaming load")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)


# -- starting it -----------------------------------------------------------------------------


def start_serve(args: argparse.Namespace, home: Path, extra: list[str]) -> tuple[
        subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(home / "serve.log", "wb")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "serve", "--port", str(port),
                             *extra], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "SLUICE_HOME": str(home)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"sluice serve exited: {(home / 'serve.log').read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("sluice serve did not become healthy")


@dataclass
class Running:
    procs: list[subprocess.Popen[bytes]]
    codes: list[int | None] = field(default_factory=list)  # exit codes, once stopped

    def stop(self) -> list[int | None]:
        for proc in self.procs:
            proc.terminate()
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(60))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(None)
        return codes


@contextlib.contextmanager
def launch(args: argparse.Namespace, home: Path) -> Iterator[tuple[str, str, str, Running]]:
    """`sluice serve` (and the stub worker with --stub), stopped on the way out; yields
    (url, dev key, model, the processes)."""
    running = Running([])
    extra = ["--log-level", "warning"]
    if args.stub:
        port = free_port()
        running.procs.append(subprocess.Popen([sys.executable, __file__, "--stub-worker",
                                               str(port)]))
        extra += ["--backend", "external", "--worker-url", f"http://127.0.0.1:{port}"]
    else:
        extra += ["--workers", str(args.workers)]
    if args.model:
        extra += ["--model", args.model]
    try:
        serve, url = start_serve(args, home, extra)
        running.procs.insert(0, serve)
        key = (home / "dev-key").read_text().strip()
        model = httpx.get(url + "/v1/models", timeout=10,
                          headers={"authorization": f"Bearer {key}"}).json()["data"][0]["id"]
        yield url, key, model, running
    finally:
        running.codes = running.stop()


# -- the stub worker (--stub) ----------------------------------------------------------------


def run_stub_worker(port: int) -> None:
    """A worker that streams 16 chunks at once per request and serves the contract's
    GET routes; enough for the gateway and router to do all their per-request work."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        body = await request.json()

        async def chunks() -> Any:
            for i in range(16):
                delta = {"choices": [{"index": 0, "delta": {"content": f"w{i} "},
                                      "finish_reason": None}]}
                yield f"data: {json.dumps(delta)}\n\n".encode()
            usage = {"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 16,
                                              "total_tokens": 36}}
            yield f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()

        del body
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def ok(_: Request) -> Response:
        return PlainTextResponse("")

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def metrics(_: Request) -> Response:
        return PlainTextResponse("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                            Route("/health", ok), Route("/v1/models", models),
                            Route("/metrics", metrics)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# -- main ------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'process':<16}{'pid':>8}{'RSS first':>11}{'last':>8}{'max dev':>9}{'MiB/h':>8}"
            f"{'fds first':>11}{'last':>6}{'max dev':>9}{'fds/h':>7}  flat")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['role']:<16}{r['pid']:>8}{r['rss_mib_first']:>11.1f}"
                     f"{r['rss_mib_last']:>8.1f}{r['rss_max_deviation']:>9.1%}"
                     f"{r['rss_mib_per_hour']:>8.1f}{r['fds_first']:>11}{r['fds_last']:>6}"
                     f"{r['fds_max_deviation']:>9}{r['fds_per_hour']:>7.1f}  "
                     f"{'yes' if r['flat'] else 'NO'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="samples before this are not judged (default: 20%% of --minutes)")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=4, help="streaming clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF)")
    p.add_argument("--stub", action="store_true",
                   help="gateway + router in front of a stub worker (no engine)")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=Path("soak-out"))
    p.add_argument("--stub-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stub_worker is not None:
        return run_stub_worker(args.stub_worker)
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None
                     else 0.2 * args.minutes)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, launch(args, Path(tmp)) as (
            url, key, model, running), open(args.out / "soak.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "pid", "role", "rss_mib", "fds"])
        samples, stats = asyncio.run(soak(url, key, model, running.procs[0].pid, args, writer))
    codes = running.codes
    rows = verdict(samples, warmup_s, args.tolerance)
    plot(args.out / "soak.png", samples, warmup_s)
    print(f"soak: {args.minutes:g} min ({warmup_s / 60:g} min warm-up), "
          f"{'stub worker' if args.stub else f'{args.workers} workers'}, model {model}, "
          f"{args.concurrency} streaming clients, max_tokens {args.max_tokens}")
    print(f"requests ok {stats.ok}, errors {stats.errors} {stats.error_kinds or ''}, "
          f"stream chunks {stats.tokens}; exit codes {codes}")
    print(table(rows))
    flat = bool(rows) and all(r["flat"] for r in rows)
    print(f"all flat within {args.tolerance:.0%}: {'yes' if flat else 'NO'}; "
          f"{args.out / 'soak.csv'}, {args.out / 'soak.png'}")
    print(json.dumps({"minutes": args.minutes, "warmup_minutes": warmup_s / 60,
                      "stub": args.stub, "workers": args.workers, "model": model,
                      "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                      "requests_ok": stats.ok, "errors": stats.errors,
                      "exit_codes": codes, "all_flat": flat, "processes": rows}))


if __name__ == "__main__":
    main()
