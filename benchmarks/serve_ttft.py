"""TTFT through `sluice serve --workers N` (gateway + router) against its workers reached
directly, same run: what the edge costs a short prompt at low load (issue 11's target:
p50 within 5%).

    flock /tmp/sluice-heavy.lock python benchmarks/serve_ttft.py [--workers 2]
        [--requests 40] [--max-tokens 8] [--model M]

Starts `sluice serve` (its own SLUICE_HOME in a temporary folder: a fresh SQLite ledger
and dev key), reads the workers' URLs from `GET /admin/workers`, then sends one streamed
chat request at a time, alternating the front door (with the dev key) and a worker
directly (the workers in turn), each pair in swapped order every other round. Every
prompt is new (a random word leads it), so neither path finds it in a prefix cache.
TTFT = first content delta, as the client sees it. Prints a table; the last stdout line
is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from sluice.control.local import free_port, stop_process

ADMIN_KEY = "serve-ttft-admin"
WORDS = ("river stone cloud lantern orbit meadow copper signal harbor violet engine quiet "
         "summer ladder pixel forest canyon ember glacier thunder").split()


def ttft(url: str, key: str | None, model: str, prompt: str, max_tokens: int) -> float:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=120) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: {resp.status_code} {resp.read()[:300]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            choices = json.loads(line[5:]).get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no content")


EDGE_HISTOGRAMS = ("sluice_gateway_admission_seconds", "sluice_router_decision_seconds")


def edge_sums(front: str) -> dict[str, float]:
    """Sums and counts of the gateway's admission and the router's decision histograms,
    from the front door's /metrics."""
    metrics = httpx.get(front + "/metrics", timeout=10,
                        headers={"authorization": f"Bearer {ADMIN_KEY}"}).text
    sums: dict[str, float] = {}
    for line in metrics.splitlines():
        for name in EDGE_HISTOGRAMS:
            for part in ("_sum", "_count"):
                if line.startswith(name + part):
                    sums[name + part] = sums.get(name + part, 0.0) + float(line.split()[-1])
    return sums


def edge_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean seconds of each histogram over the requests between two `edge_sums`."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {name: delta[name + "_sum"] / delta[name + "_count"] for name in EDGE_HISTOGRAMS
            if delta.get(name + "_count")}


def start_serve(args: argparse.Namespace, home: str, port: int) -> tuple[subprocess.Popen[str],
                                                                            list[str]]:
    cmd = [sys.executable, "-m", "sluice.cli", "serve", "--workers", str(args.workers),
           "--port", str(port), "--admin-key", ADMIN_KEY, "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SLUICE_HOME": home})
    log: list[str] = []

    def collect() -> None:
        for line in iter(proc.stderr.readline, ""):  # type: ignore[union-attr]
            log.append(line)

    threading.Thread(target=collect, daemon=True).start()
    return proc, log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40, help="per path")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    port = free_port()
    front = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="sluice-serve-ttft-") as home:
        proc, log = start_serve(args, home, port)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if httpx.get(front + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit("sluice serve exited:\n" + "".join(log))
                time.sleep(0.5)
            else:
                raise SystemExit("sluice serve did not become healthy:\n" + "".join(log))
            key = open(os.path.join(home, "dev-key")).read().strip()
            listed = httpx.get(front + "/admin/workers", timeout=10,
                               headers={"authorization": f"Bearer {ADMIN_KEY}"}).json()
            workers = [w["url"] for pool in listed["pools"] for w in pool["workers"]]
            model = listed["pools"][0]["models"][0]
            print(f"# sluice serve --workers {args.workers} on {front}; workers {workers}",
                  file=sys.stderr, flush=True)
            for target, k in ((front, key), *((w, None) for w in workers)):  # warm-up
                for _ in range(2):
                    ttft(target, k, model, f"{rng.choice(WORDS)} warm up", args.max_tokens)
            times: dict[str, list[float]] = {"serve": [], "direct": []}
            before = edge_sums(front)
            for i in range(args.requests):
                pair = [("serve", front, key), ("direct", workers[i % len(workers)], None)]
                for name, url, k in (pair if i % 2 == 0 else pair[::-1]):
                    prompt = f"{rng.choice(WORDS)} {rng.randrange(10**6)}: say hello briefly."
                    times[name].append(ttft(url, k, model, prompt, args.max_tokens))
            inside = edge_means(before, edge_sums(front))
        finally:
            stop_process(proc, drain=True, timeout_s=60)
    p50 = {name: statistics.median(v) for name, v in times.items()}
    mean = {name: statistics.fmean(v) for name, v in times.items()}
    print(f"{'path':<8}{'TTFT p50 ms':>13}{'mean ms':>10}{'min ms':>9}{'max ms':>9}")
    for name, v in times.items():
        print(f"{name:<8}{p50[name] * 1e3:>13.2f}{mean[name] * 1e3:>10.2f}"
              f"{min(v) * 1e3:>9.2f}{max(v) * 1e3:>9.2f}")
    ratio = p50["serve"] / p50["direct"]
    print(f"serve / direct TTFT p50: {ratio:.3f} (target <= 1.05)")
    for name, seconds in inside.items():
        print(f"mean {name}: {seconds * 1e3:.3f} ms")
    cpu = next((m.group(1) for m in re.finditer(r"model name\s*:\s*(.*)",
                                                 open("/proc/cpuinfo").read())), "?")
    doc: dict[str, Any] = {"benchmark": "serve_ttft", "cpu": cpu, "workers": args.workers,
                           "requests": args.requests, "max_tokens": args.max_tokens,
                           "p50_ms": {k: round(v * 1e3, 3) for k, v in p50.items()},
                           "mean_ms": {k: round(v * 1e3, 3) for k, v in mean.items()},
                           "ratio_p50": round(ratio, 4),
                           "edge_mean_ms": {k: round(v * 1e3, 3) for k, v in inside.items()}}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
