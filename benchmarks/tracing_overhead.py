"""Tracing overhead: the same servers with OpenTelemetry off and on (100% sampling).

Targets (issue 16): tracing on costs at most 3% of output tokens/s at 32 streams, and at
most 0.2 ms of p50 latency added at the router; off costs nothing measurable.

Two parts, each comparing twin processes in the same run, in alternating rounds
(off, on, off, on, ...) so drift on the shared machine hits both alike:

1. router: a stub worker (router_overhead.py's: fixed answers, no engine) behind two
   `sluice router` processes, one with `--otlp-traces-endpoint` pointed at a local
   OTLP/HTTP sink process (it reads and acknowledges each export, as a collector would).
   Open-loop fixed rate -> p50/p99 latency; closed loop -> saturation req/s.
2. engine: two `sluice worker` processes on the default model (one traced), driven by
   `sluice bench serve` with 32 concurrent streams, fixed output length (ignore_eos),
   one target at a time in ABBA order: output tokens/s of each, and the CPU seconds the
   worker's processes (front end + engine core) spent per output token, which other
   load on a shared machine does not inflate the way it does tokens/s.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/tracing_overhead.py

Prints a table; the last stdout line is one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

import httpx
from router_overhead import measure, start, wait_http

from sluice.control.local import free_port

SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
stats = {"exports": 0, "bytes": 0}
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", 0))
        self.rfile.read(n)
        stats["exports"] += 1; stats["bytes"] += n
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def do_GET(self):
        body = repr(stats).replace("'", '"').encode()
        self.send_response(200); self.send_header("content-length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def router_part(args: argparse.Namespace, sink: str, procs: list[Any]) -> dict[str, Any]:
    stub_port = free_port()
    procs.append(start([sys.executable, "-c", "import uvicorn, router_overhead as b; "
                        f"uvicorn.run(b.stub_app, host='127.0.0.1', port={stub_port}, "
                        "log_level='warning', access_log=False)"]))
    stub = f"http://127.0.0.1:{stub_port}"
    wait_http(stub + "/health")
    ports = {}
    for name, extra in (("off", []), ("on", ["--otlp-traces-endpoint", sink + "/v1/traces"])):
        ports[name] = free_port()
        procs.append(start([sys.executable, "-m", "sluice.cli", "router", "--worker", stub,
                            "--policy", "round_robin", "--port", str(ports[name]),
                            "--log-level", "warning", *extra]))
        wait_http(f"http://127.0.0.1:{ports[name]}/health")
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name in ("off", "on"):
            runs[name].append(measure(f"router tracing {name}", ports[name], args))
    out: dict[str, Any] = {}
    for name, results in runs.items():
        rate = str(int(args.rates[0]))
        out[name] = {
            "p50_ms": statistics.median(r["fixed_rate"][rate]["p50_ms"] for r in results),
            "p99_ms": statistics.median(r["fixed_rate"][rate]["p99_ms"] for r in results),
            "saturation_rps": statistics.median(r["saturation_rps"] for r in results),
            "runs": results}
    out["added_p50_ms"] = out["on"]["p50_ms"] - out["off"]["p50_ms"]
    out["saturation_change"] = out["on"]["saturation_rps"] / out["off"]["saturation_rps"] - 1
    return out


def _throughputs(doc: dict[str, Any]) -> list[float]:
    found: list[float] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            if "output_throughput" in obj:
                found.append(float(obj["output_throughput"]))
                return
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(doc["results"])
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its children (the worker's engine core)."""
    import psutil

    proc = psutil.Process(pid)
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        t = p.cpu_times()
        total += t.user + t.system
    return total


def bench_once(url: str, args: argparse.Namespace) -> float:
    """One `sluice bench serve` run against `url`: its output tokens/s."""
    cmd = [sys.executable, "-m", "sluice.cli", "bench", "serve", "--base-url", url,
           "--workload", "random", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", "0",
           "--warmup", "2", "--disable-tqdm"]
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    (tps,) = _throughputs(json.loads(result.stdout.strip().splitlines()[-1]))
    return tps


def engine_part(args: argparse.Namespace, sink: str, procs: list[Any]) -> dict[str, Any]:
    """Twin workers; rounds in ABBA order; tok/s and the worker's own CPU per token."""
    urls, pids = {}, {}
    for name, extra in (("off", []), ("on", ["--otlp-traces-endpoint", sink + "/v1/traces"])):
        port = free_port()
        p = start([sys.executable, "-m", "sluice.cli", "worker", "--port", str(port),
                   "--max-num-seqs", str(args.concurrency), "--log-level", "warning", *extra])
        procs.append(p)
        urls[name], pids[name] = f"http://127.0.0.1:{port}", p.pid
    for url in urls.values():
        wait_http(url + "/health", timeout=300)
    order = (["off", "on", "on", "off"] * args.rounds)[:2 * args.rounds]
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    tokens = args.num_prompts * args.output_len
    for name in order:
        before = cpu_seconds(pids[name])
        tps = bench_once(urls[name], args)
        cpu = cpu_seconds(pids[name]) - before
        runs[name].append({"output_tok_s": tps, "cpu_ms_per_token": 1e3 * cpu / tokens})
    out: dict[str, Any] = {
        name: {"output_tok_s": statistics.median(r["output_tok_s"] for r in v),
               "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in v),
               "runs": v} for name, v in runs.items()}
    out["order"] = order
    out["throughput_change"] = out["on"]["output_tok_s"] / out["off"]["output_tok_s"] - 1
    out["cpu_per_token_change"] = (out["on"]["cpu_ms_per_token"]
                                   / out["off"]["cpu_ms_per_token"] - 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2,
                    help="router: rounds of (off, on); engine: runs per target, ABBA order")
    ap.add_argument("--seconds", type=float, default=3.0, help="router: seconds per phase")
    ap.add_argument("--rates", type=float, nargs="+", default=[300.0],
                    help="router: open-loop request rate (the first is reported)")
    ap.add_argument("--stream-events", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--skip-router", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    procs: list[Any] = []
    doc: dict[str, Any] = {"benchmark": "tracing_overhead"}
    try:
        sink_port = free_port()
        procs.append(start([sys.executable, "-c", SINK, str(sink_port)]))
        sink = f"http://127.0.0.1:{sink_port}"
        wait_http(sink + "/")
        if not args.skip_router:
            doc["router"] = router_part(args, sink, procs)
        if not args.skip_engine:
            doc["engine"] = engine_part(args, sink, procs)
        doc["sink"] = httpx.get(sink + "/", timeout=5).json()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
    report(doc)
    print(json.dumps(doc, default=str))
    return 0


def report(doc: dict[str, Any]) -> None:
    if "router" in doc:
        r = doc["router"]
        print(f"router   p50 off {r['off']['p50_ms']:.3f} ms  on {r['on']['p50_ms']:.3f} ms  "
              f"added {r['added_p50_ms']:+.3f} ms (target <= 0.2)   p99 off "
              f"{r['off']['p99_ms']:.2f} on {r['on']['p99_ms']:.2f} ms   saturation off "
              f"{r['off']['saturation_rps']:.0f} on {r['on']['saturation_rps']:.0f} req/s")
    if "engine" in doc:
        e = doc["engine"]
        print(f"engine   output tok/s off {e['off']['output_tok_s']:.1f}  on "
              f"{e['on']['output_tok_s']:.1f}  change {100 * e['throughput_change']:+.1f}% "
              "(target >= -3%)")
        print(f"         worker CPU per output token off {e['off']['cpu_ms_per_token']:.2f} ms  "
              f"on {e['on']['cpu_ms_per_token']:.2f} ms  change "
              f"{100 * e['cpu_per_token_change']:+.1f}%   runs {e['order']}")
    print(f"sink     {doc.get('sink')}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
