"""A stepped load against an autoscaled `sluice serve`: replicas follow the load, the
SLO comes back after a step, nothing fails, nothing flaps.

    open-loop client ── Poisson arrivals at a stepped rate (base, base x step, base),
       │                streaming chat, `ignore_eos`, the dev key
    sluice serve --min-workers 1 --max-workers 3 --slo ttft=..,itl=..   (a subprocess,
       │         gateway + router + the planner, as a user runs it)
    `sluice worker`s started and drained by the planner through --backend local | ray

Every second the script reads `GET /admin/planner` (ready, starting, desired, the
decision's reason and predictions). Per request it keeps the send time, TTFT, end and
any failure (a non-200, an error event, a stream without [DONE] or short of
max_tokens).

Reported (the last stdout line is one JSON document; --out gets autoscale.json and,
with matplotlib, autoscale.png: rate, replicas and windowed p90 TTFT over time):

    failed             requests that did not complete (target: 0)
    recovery_s         after the step: the end of the last --window-s window (by send
                       time) whose p90 TTFT is over the SLO, less the step's start; 0 when
                       no window is over (target: <= 60 s)
    settled_events     replica changes under constant load once settled: in the base
                       phase after --settle-s, and in the stepped phase after its last
                       scale-up plus --settle-s (target: 0)
    replicas           per phase: at its start, most, at its end (they must rise in the
                       step and come back down after it)

On a 2-core machine a worker's engine uses every core unless told otherwise, so more
workers would add no compute: `--threads-per-worker 1` (the default) sets
OMP_NUM_THREADS=1 for the workers, so two workers have twice one worker's compute and
a third shares the cores. Pick --rate so one worker meets the SLO at the base rate and
not at rate x --step (`--probe` prints one worker's TTFT at a given rate first).

    python benchmarks/autoscale.py                                  # ~12 min
    python benchmarks/autoscale.py --phases 120 300 300 --rate 0.6 --step 3
    python benchmarks/autoscale.py --backend ray --ray-nodes 2     # a loopback Ray cluster

`--backend ray --ray-nodes N` starts a Ray cluster of N nodes on loopback in this process
(`ray.cluster_utils.Cluster`, --ray-node-cpus logical CPUs each; Ray sets an actor's
OMP_NUM_THREADS to its one CPU) and points `sluice serve --ray-address` at it;
`--ray-address` joins a running cluster instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sluice.control.planner import SLO

WORDS = ("river stone cloud lamp orbit maple quiet signal harbor copper meadow lantern "
         "velvet summit ember canyon glacier thistle marble falcon").split()
ADMIN_KEY = "autoscale-bench-admin"


@dataclass
class Request:
    start: float
    ttft: float | None = None
    end: float | None = None
    tokens: int = 0
    failure: str | None = None


@dataclass
class Sample:
    at: float
    ready: int
    starting: int
    desired: int | None
    reason: str | None
    decision: dict[str, Any] | None = None  # the planner's last, whole (inputs, predictions)


@dataclass
class Run:
    t0: float = 0.0
    phases: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, rate)
    requests: list[Request] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


def say(message: str) -> None:
    print(f"[autoscale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# -- the server ------------------------------------------------------------------------------------


def start_ray(args: argparse.Namespace) -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": args.ray_node_cpus})
    for _ in range(args.ray_nodes - 1):
        cluster.add_node(num_cpus=args.ray_node_cpus)
    cluster.wait_for_nodes()
    say(f"Ray cluster on loopback: {args.ray_nodes} nodes x {args.ray_node_cpus} CPUs at "
        f"{cluster.address}")
    return cluster


def start_serve(args: argparse.Namespace, port: int, home: Path, log: Path) -> subprocess.Popen[bytes]:
    sluice = Path(sys.executable).parent / "sluice"
    cmd = [str(sluice), "serve", "--port", str(port), "--admin-key", ADMIN_KEY,
           "--backend", args.backend, "--min-workers", "1", "--max-workers", str(args.max_workers),
           "--slo", args.slo, "--scale-up-delay", str(args.scale_up_delay),
           "--scale-down-delay", str(args.scale_down_delay), "--log-level", "info",
           *(["--ray-address", args.ray_address] if args.ray_address else []),
           *args.serve_args]
    environ = {**os.environ, "SLUICE_HOME": str(home)}
    if args.threads_per_worker:
        environ["OMP_NUM_THREADS"] = str(args.threads_per_worker)
    say(f"starting: {' '.join(cmd)} (log {log})")
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environ,
                                start_new_session=True)


async def wait_ready(c: httpx.AsyncClient, base: str, proc: subprocess.Popen[bytes],
                     timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice serve exited with {proc.returncode}")
        try:
            if (await c.get(f"{base}/health", timeout=2)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"sluice serve not healthy after {timeout_s:.0f} s")


def stop_serve(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the client ------------------------------------------------------------------------------------


async def one(c: httpx.AsyncClient, base: str, key: str, body: dict[str, Any], r: Request) -> None:
    try:
        async with c.stream("POST", f"{base}/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {key}"}) as resp:
            if resp.status_code != 200:
                r.failure = f"{resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.failure = f"error event: {chunk['error']}"
                    return
                choices = chunk.get("choices") or []
                if r.ttft is None and choices and choices[0].get("delta", {}).get("content"):
                    r.ttft = time.monotonic() - r.start
                if chunk.get("usage"):
                    r.tokens = chunk["usage"]["completion_tokens"]
            if not done:
                r.failure = "stream ended without [DONE]"
            elif r.tokens != body["max_tokens"]:
                r.failure = f"short stream: {r.tokens} of {body['max_tokens']} tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        r.failure = f"{type(exc).__name__}: {exc}"
    finally:
        r.end = time.monotonic()


async def load(c: httpx.AsyncClient, base: str, key: str, args: argparse.Namespace,
               run: Run) -> None:
    rng = random.Random(args.seed)
    tasks: list[asyncio.Task[None]] = []
    start = time.monotonic()
    for seconds, rate in zip(args.phases, args.rates, strict=True):
        end = start + seconds
        run.phases.append((start - run.t0, end - run.t0, rate))
        say(f"phase: {rate:.2f} req/s for {seconds:.0f} s")
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            await asyncio.sleep(max(0.0, t - time.monotonic()))
            body = {"model": args.model_name, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                    "temperature": 0, "max_tokens": args.output_len,
                    "messages": [{"role": "user", "content": prompt(rng, args.input_words)}]}
            r = Request(start=time.monotonic())
            run.requests.append(r)
            tasks.append(asyncio.create_task(one(c, base, key, body, r)))
        start = end
    say(f"all {len(tasks)} requests sent; waiting for the last ones")
    await asyncio.gather(*tasks)


async def watch(c: httpx.AsyncClient, base: str, run: Run, stop: asyncio.Event) -> None:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    last: tuple[int, int, int | None] | None = None
    while not stop.is_set():
        try:
            pools = (await c.get(f"{base}/admin/planner", headers=headers, timeout=5)).json()["pools"]
            pool = pools[0]
            decision = pool["decisions"][-1] if pool["decisions"] else {}
            sample = Sample(at=time.monotonic() - run.t0, ready=len(set(pool["workers"]) - set(pool["draining"])),
                            starting=pool["starting"], desired=pool["desired"],
                            reason=decision.get("reason"), decision=decision or None)
            run.samples.append(sample)
            run.events = pool["events"]
            now = (sample.ready, sample.starting, sample.desired)
            if now != last:
                say(f"ready {sample.ready} starting {sample.starting} desired {sample.desired} "
                    f"({sample.reason})")
                last = now
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            say(f"planner read failed: {exc}")
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


# -- the numbers -----------------------------------------------------------------------------------


def p90(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def windows(run: Run, lo: float, hi: float, width: float) -> list[tuple[float, float | None, int]]:
    """(window end, p90 TTFT of requests sent in it, count) over [lo, hi) in run time."""
    out = []
    t = lo
    while t < hi:
        sent = [r for r in run.requests if t <= r.start - run.t0 < t + width]
        out.append((t + width, p90([r.ttft for r in sent if r.ttft is not None]), len(sent)))
        t += width
    return out


def replicas_at(run: Run, t: float) -> int | None:
    before = [s for s in run.samples if s.at <= t]
    return before[-1].ready if before else None


def changes(run: Run, lo: float, hi: float) -> list[tuple[float, int, int]]:
    """(time, from, to) for each change of the ready count within [lo, hi)."""
    out = []
    prev: int | None = None
    for s in run.samples:
        if prev is not None and s.ready != prev and lo <= s.at < hi:
            out.append((s.at, prev, s.ready))
        prev = s.ready
    return out


def summarize(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    ttft_slo = SLO.parse(args.slo).ttft_s
    (b0, b1, _), (s0, s1, _) = run.phases[0], run.phases[1]
    over = [end for end, q, _ in windows(run, s0, s1, args.window_s) if q is not None and q > ttft_slo]
    ups = [t for t, a, b in changes(run, s0, s1) if b > a]
    settle_from = (ups[-1] if ups else s0) + args.settle_s
    settled = changes(run, b0 + args.settle_s, b1) + changes(run, settle_from, s1)
    phases = []
    for start, end, rate in run.phases:
        inside = [s.ready for s in run.samples if start <= s.at < end]
        sent = [r for r in run.requests if start <= r.start - run.t0 < end]
        phases.append({
            "rate": rate, "seconds": end - start, "requests": len(sent),
            "failed": sum(r.failure is not None for r in sent),
            "ttft_p90_s": p90([r.ttft for r in sent if r.ttft is not None]),
            "replicas_start": replicas_at(run, start), "replicas_max": max(inside, default=None),
            "replicas_end": replicas_at(run, end)})
    # the last phase's scale-down may come after its requests stop: wait for it is the
    # caller's job (--tail-s); report the count at the very end too
    failed = [r for r in run.requests if r.failure is not None]
    recovery = (max(over) - s0) if over else 0.0
    came_down = run.samples[-1].ready if run.samples else None
    result = {
        "requests": len(run.requests), "failed": len(failed),
        "failures": sorted({r.failure or "" for r in failed})[:10],
        "slo": args.slo, "recovery_s": recovery, "settled_events": len(settled),
        "settled_changes": settled, "phases": phases, "replicas_final": came_down,
        "target_met": (not failed and recovery <= 60.0 and not settled
                       and phases[1]["replicas_max"] is not None
                       and phases[1]["replicas_max"] > (phases[0]["replicas_max"] or 0)
                       and came_down is not None and came_down < phases[1]["replicas_max"]),
    }
    return result


def plot(path: Path, run: Run, args: argparse.Namespace) -> str:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ttft_slo = SLO.parse(args.slo).ttft_s
    end = max(s.at for s in run.samples) if run.samples else run.phases[-1][1]
    fig, (ax_rate, ax_rep, ax_ttft) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    xs, ys = [], []
    for start, stop, rate in run.phases:
        xs += [start, stop]
        ys += [rate, rate]
    ax_rate.plot(xs, ys, color="tab:blue")
    ax_rate.set(ylabel="offered req/s", title=f"sluice serve --backend {args.backend}: "
                f"stepped load, --slo {args.slo}")
    ax_rep.step([s.at for s in run.samples], [s.ready for s in run.samples], where="post",
                label="ready", color="tab:green")
    ax_rep.step([s.at for s in run.samples], [s.ready + s.starting for s in run.samples],
                where="post", label="ready + starting", color="tab:olive", linestyle="--")
    ax_rep.set(ylabel="workers")
    ax_rep.legend(fontsize=8)
    w = windows(run, 0.0, end, args.window_s)
    ax_ttft.plot([e for e, q, _ in w if q is not None], [q for _, q, _ in w if q is not None],
                 marker=".", color="tab:red", label=f"p90 TTFT per {args.window_s:.0f} s window")
    ax_ttft.axhline(ttft_slo, color="grey", linestyle=":", label="SLO")
    failed = [r for r in run.requests if r.failure is not None]
    if failed:
        ax_ttft.scatter([r.start - run.t0 for r in failed], [ttft_slo] * len(failed),
                        marker="x", color="black", label="failed")
    ax_ttft.set(ylabel="TTFT (s)", xlabel="s since the load began", yscale="log")
    ax_ttft.legend(fontsize=8)
    for ax in (ax_rate, ax_rep, ax_ttft):
        for start, _, _ in run.phases[1:]:
            ax.axvline(start, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


# -- main ------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="sluice-autoscale-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cluster = start_ray(args) if args.backend == "ray" and not args.ray_address else None
    if cluster is not None:
        args.ray_address = cluster.address
    proc = start_serve(args, port, home, out / "serve.log")
    run = Run()
    try:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as c:
            await wait_ready(c, base, proc, args.start_timeout)
            key = (home / "dev-key").read_text().strip()
            models = (await c.get(f"{base}/v1/models",
                                  headers={"authorization": f"Bearer {key}"})).json()
            args.model_name = models["data"][0]["id"]
            say(f"ready: {args.model_name}; {args.warmup} warm-up requests")
            for _ in range(args.warmup):
                r = Request(start=time.monotonic())
                await one(c, base, key, {"model": args.model_name, "stream": True,
                                         "ignore_eos": True, "max_tokens": args.output_len,
                                         "stream_options": {"include_usage": True},
                                         "messages": [{"role": "user", "content": "hello"}]}, r)
                if r.failure:
                    raise RuntimeError(f"warm-up failed: {r.failure}")
            run.t0 = time.monotonic()
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(c, base, run, stop))
            await load(c, base, key, args, run)
            say(f"load done; watching {args.tail_s:.0f} s more for the scale-down")
            await asyncio.sleep(args.tail_s)
            stop.set()
            await watcher
    finally:
        stop_serve(proc)
        if cluster is not None:
            cluster.shutdown()
    result = summarize(run, args)
    result["command"] = " ".join(sys.argv)
    result["backend"] = args.backend
    result["plot"] = plot(out / "autoscale.png", run, args)
    (out / "autoscale.json").write_text(json.dumps(
        {**result, "requests_detail": [asdict(r) for r in run.requests],
         "samples": [asdict(s) for s in run.samples], "events": run.events,
         "t0": run.t0}, indent=1))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="local", choices=["local", "ray"])
    p.add_argument("--ray-address", default=None, help="--backend ray: the cluster to join")
    p.add_argument("--ray-nodes", type=int, default=2,
                   help="--backend ray without --ray-address: nodes of the loopback cluster")
    p.add_argument("--ray-node-cpus", type=int, default=2, help="logical CPUs per Ray node")
    p.add_argument("--rate", type=float, default=0.5, help="base request rate, req/s")
    p.add_argument("--step", type=float, default=3.0, help="the stepped phase's rate multiple")
    p.add_argument("--phases", type=float, nargs=3, default=[120.0, 300.0, 240.0],
                   metavar=("BASE", "STEP", "AFTER"), help="seconds of each phase")
    p.add_argument("--tail-s", type=float, default=60.0,
                   help="seconds to keep watching the replicas after the last request")
    p.add_argument("--slo", default="ttft=2s,itl=200ms")
    p.add_argument("--max-workers", type=int, default=3)
    p.add_argument("--scale-up-delay", type=float, default=5.0)
    p.add_argument("--scale-down-delay", type=float, default=60.0)
    p.add_argument("--threads-per-worker", type=int, default=1,
                   help="OMP_NUM_THREADS for the workers (0: leave it unset)")
    p.add_argument("--input-words", type=int, default=100, help="prompt words (~1.3 tokens each)")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens (ignore_eos)")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default="/tmp/sluice-autoscale")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="more `sluice serve` flags (last on the line)")
    args = p.parse_args()
    args.rates = [args.rate, args.rate * args.step, args.rate]
    result = asyncio.run(main_async(args))
    say(f"failed {result['failed']} of {result['requests']}; recovery {result['recovery_s']:.0f} s; "
        f"settled scale events {result['settled_events']}; phases "
        + "; ".join(f"{p['rate']:.2f}/s: replicas {p['replicas_start']}->{p['replicas_max']}"
                    f"->{p['replicas_end']}, p90 TTFT {p['ttft_p90_s']}" for p in result["phases"])
        + f"; final {result['replicas_final']}; target met: {result['target_met']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
