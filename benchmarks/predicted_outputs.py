"""Predicted outputs through HTTP: code edits answered with and without OpenAI's
`prediction`, against n-gram prompt lookup (vLLM's nearest feature), in one run.

    flock /tmp/sluice-heavy.lock .venv/bin/python benchmarks/predicted_outputs.py \\
        [--model PATH] [--dtype float32] [--tasks 8] [--rounds 2] [--lines 15 40]

Tasks: `--tasks` functions of sluice's own source (15 to 40 lines by default), each
with a request to rename one of its local variables and answer with the whole code
only. Two `sluice worker`s run side by side (one request in flight at a
time, so they never share the cores): a plain one and one with `--speculative-config
'{"method": "ngram"}'` (prompt lookup: the code is in the prompt). Each task is asked
three ways in turn, `--rounds` times: the plain worker without a prediction (the
baseline), the plain worker with `prediction` = the original code (what OpenAI's guide
does for an edit), and the n-gram worker without one. Greedy (temperature 0),
`max_tokens` the code's length plus 64. Reports per way the median seconds a request,
output tokens/s over all requests, the speed-up against the baseline (median over
tasks of the per-task ratio of times), the accepted and rejected prediction tokens,
and whether every answer equals the baseline's. Progress on stderr; the last stdout line
is one JSON document.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
from serve_vs_vllm import cpu_info, wait_healthy  # benchmarks/ is on sys.path as a script

from sluice.control.local import free_port
from sluice.engine.tokenizer import resolve_model

SOURCES = ["router/pool.py", "gateway/limits.py", "engine/block_manager.py",
           "engine/scheduler.py", "control/planner.py", "protocol/prompt.py"]
WAYS = ("baseline", "prediction", "ngram")


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def tasks_from_source(count: int, lines: tuple[int, int]) -> list[tuple[str, str, str]]:
    """(code, old name, new name): functions of `SOURCES` whose source has `lines` lines
    (at least, at most), each with a local variable to rename (the first assigned)."""
    root = Path(__file__).resolve().parent.parent / "src" / "sluice"
    out: list[tuple[str, str, str]] = []
    for source in SOURCES:
        text = (root / source).read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            code = textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")
            if not lines[0] <= code.count("\n") + 1 <= lines[1]:
                continue
            names = [t.id for n in ast.walk(node) if isinstance(n, ast.Assign)
                     for t in n.targets if isinstance(t, ast.Name) and len(t.id) > 3]
            if names:
                out.append((code, names[0], names[0] + "_new"))
            if len(out) == count:
                return out
    return out


def ask(url: str, model: str, task: tuple[str, str, str], max_tokens: int,
        prediction: bool) -> dict[str, Any]:
    code, old, new = task
    body: dict[str, Any] = {
        "model": model, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": f"Rename `{old}` to `{new}` in this code. "
                      f"Answer with the whole code only, no explanation.\n\n{code}"}]}
    if prediction:
        body["prediction"] = {"type": "content", "content": code}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    details = data["usage"].get("completion_tokens_details") or {}
    return {"seconds": seconds, "tokens": data["usage"]["completion_tokens"],
            "text": data["choices"][0]["message"]["content"],
            "accepted": details.get("accepted_prediction_tokens", 0),
            "rejected": details.get("rejected_prediction_tokens", 0)}


def start(path: str, dtype: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.cli", "worker", "--model", path, "--port", str(port),
           "--dtype", dtype, "--log-level", "warning", *extra]
    say(f"starting: {' '.join(cmd)}")
    return subprocess.Popen(cmd), f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M GGUF")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lines", type=int, nargs=2, default=[15, 40], metavar=("MIN", "MAX"),
                    help="a task's function has this many lines")
    args = ap.parse_args()
    path = resolve_model(args.model)
    tasks = tasks_from_source(args.tasks, (args.lines[0], args.lines[1]))
    procs = [start(path, args.dtype, []),
             start(path, args.dtype, ["--speculative-config", '{"method": "ngram"}'])]
    try:
        for proc, url in procs:
            wait_healthy(url, 300, proc, None)
        (_, plain), (_, ngram) = procs
        model = httpx.get(plain + "/v1/models").json()["data"][0]["id"]
        budgets = [httpx.post(plain + "/tokenize", json={
            "prompt": code, "add_special_tokens": False}).json()["count"] + 64
            for code, _, _ in tasks]
        for url in (plain, ngram):  # warm-up (the prediction's step-time curve too)
            ask(url, model, tasks[0], 16, url == plain)
        runs: dict[str, list[list[dict[str, Any]]]] = {w: [[] for _ in tasks] for w in WAYS}
        for rnd in range(args.rounds):
            for i, task in enumerate(tasks):
                for way in WAYS:
                    out = ask(ngram if way == "ngram" else plain, model, task, budgets[i],
                              way == "prediction")
                    runs[way][i].append(out)
                say(f"round {rnd + 1} task {i + 1}: " + ", ".join(
                    f"{w} {runs[w][i][-1]['seconds']:.2f} s" for w in WAYS))
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(30)
    base = runs["baseline"]
    result: dict[str, Any] = {}
    for way in WAYS:
        flat = [r for task in runs[way] for r in task]
        same = all(r["text"] == base[i][0]["text"] for i, task in enumerate(runs[way])
                   for r in task)
        speedup = [statistics.median(b["seconds"] for b in base[i])
                   / statistics.median(r["seconds"] for r in task)
                   for i, task in enumerate(runs[way])]
        result[way] = {
            "request_s_p50": statistics.median(r["seconds"] for r in flat),
            "output_tok_s": sum(r["tokens"] for r in flat) / sum(r["seconds"] for r in flat),
            "speedup_p50": statistics.median(speedup), "speedup_min": min(speedup),
            "speedup_max": max(speedup), "same_answers": same,
            "accepted_prediction_tokens": sum(r["accepted"] for r in flat),
            "rejected_prediction_tokens": sum(r["rejected"] for r in flat)}
    print(f"{'way':12} {'request p50 s':>14} {'output tok/s':>13} {'speed-up p50':>13} "
          f"{'(min-max)':>12} {'accepted':>9} {'rejected':>9} same")
    for way, r in result.items():
        print(f"{way:12} {r['request_s_p50']:14.2f} {r['output_tok_s']:13.1f} "
              f"{r['speedup_p50']:13.2f} {r['speedup_min']:5.2f}-{r['speedup_max']:<5.2f} "
              f"{r['accepted_prediction_tokens']:9d} {r['rejected_prediction_tokens']:9d} "
              f"{r['same_answers']}")
    print(json.dumps({"benchmark": "predicted_outputs", "cpu": cpu_info(), "model": path,
                      "dtype": args.dtype, "tasks": len(tasks), "rounds": args.rounds,
                      "lines": args.lines, "results": result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
