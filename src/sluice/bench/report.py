"""Presenting results: a terminal table, a JSON file, a plot, ratios between endpoints.

With `--compare`, each endpoint is one column and every later endpoint gets a ratio
column against the first (`value / first`), so a noisy shared machine still gives a
fair comparison: both ran the same seeded workload in the same invocation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sluice.bench.client import RequestRecord
from sluice.protocol.errors import InvalidRequestError

# (label, key in the summary, format)
ROWS: tuple[tuple[str, str, str], ...] = (
    ("Successful requests", "completed", "d"),
    ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration_s", ".2f"),
    ("Total input tokens", "total_input_tokens", "d"),
    ("Total output tokens", "total_output_tokens", "d"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".1f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("Goodput (req/s)", "goodput", ".2f"),
    *(
        (f"{stat} {label} (ms)", f"{stat.lower()}_{key}_ms", ".1f")
        for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E"))
        for stat in ("Mean", "P50", "P90", "P99")
    ),
    ("Prefix cache hit rate (server)", "server_prefix_cache_hit_rate", ".3f"),
    ("Prefix cache queries (server)", "server_prefix_cache_queries", ".0f"),
    ("Preemptions (server)", "server_num_preemptions", ".0f"),
)


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "d":
        return str(int(value))
    return format(float(value), fmt)


def ratios(results: Sequence[dict[str, Any]]) -> list[dict[str, float | None]]:
    """For each endpoint after the first: {key: value / first's value} over numeric rows."""
    base = results[0]
    out = []
    for res in results[1:]:
        row: dict[str, float | None] = {}
        for _, key, _ in ROWS:
            a, b = res.get(key), base.get(key)
            ok = isinstance(a, int | float) and isinstance(b, int | float) and b != 0
            row[key] = float(a) / float(b) if ok else None  # type: ignore[arg-type]
        out.append(row)
    return out


def table(results: Sequence[dict[str, Any]], title: str = "Serving Benchmark Result") -> str:
    """The human table: one column per endpoint, ratio columns when there are several."""
    heads = ["metric"] + [str(r["base_url"]) for r in results]
    rats = ratios(results) if len(results) > 1 else []
    heads += [f"ratio {i + 2}/1" for i in range(len(rats))]
    lines = []
    for label, key, fmt in ROWS:
        if all(r.get(key) is None for r in results):
            continue
        cells = [label] + [_fmt(r.get(key), fmt) for r in results]
        cells += [_fmt(rat[key], ".3f") for rat in rats]
        lines.append(cells)
    errors = [", ".join(f"{k}: {v}" for k, v in r.get("errors", {}).items()) or "-" for r in results]
    if any(e != "-" for e in errors):
        lines.append(["Errors"] + errors + [""] * len(rats))
    widths = [max(len(row[i]) for row in [heads, *lines]) for i in range(len(heads))]
    bar = "=" * (sum(widths) + 3 * (len(widths) - 1))
    render = [" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in [heads, *lines]]
    return "\n".join([f" {title} ".center(len(bar), "="), render[0], "-" * len(bar), *render[1:], bar])


def throughput_over_time(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[dict[str, float]]:
    """Output tokens per second in `bin_s` bins, each chunk weighted by its request's
    tokens per chunk (a server may pack several tokens into one chunk)."""
    bins: dict[int, float] = {}
    for r in records:
        if not r.ok or not r.token_times:
            continue
        weight = r.output_tokens / len(r.token_times)
        for t in r.token_times:
            k = int(t // bin_s)
            bins[k] = bins.get(k, 0.0) + weight
    if not bins:
        return []
    return [{"t": k * bin_s, "tokens_per_s": bins.get(k, 0.0) / bin_s} for k in range(max(bins) + 1)]


def check_output(path: str | None, flag: str) -> None:
    """Refuse an output file that cannot be created, before the run whose results it
    would hold (`--json`, `--plot`), not after it."""
    if path and (Path(path).is_dir() or not Path(path).resolve().parent.is_dir()):
        raise InvalidRequestError(f"{flag} {path}: no such directory, or a directory",
                                  param=flag.lstrip("-"))


def check_plot(path: str | None) -> None:
    """`--plot FILE`: a writable place (`check_output`) in a format matplotlib writes,
    refused before the run, not by `savefig` after it."""
    check_output(path, "--plot")
    suffix = Path(path).suffix.lstrip(".").lower() if path else ""
    if suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise InvalidRequestError(f"--plot {path}: matplotlib does not write .{suffix} "
                                      f"(use one of {', '.join(sorted(formats))})", param="plot")


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    text = json.dumps(_finite(document), indent=2, default=str, allow_nan=False)
    Path(path).write_text(text, encoding="utf-8")


def _finite(obj: Any) -> Any:
    """JSON has no inf/nan: write them as strings ("inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


PER_RUN_SERIES = ("requests", "throughput_over_time")


def summary_line(document: dict[str, Any], series: Sequence[str] = PER_RUN_SERIES) -> str:
    """The last stdout line: everything but each result's `series` (the per-request
    records and the series over time, which `--json` holds), on one line."""
    slim = {k: v for k, v in document.items() if k != "results"}
    slim["results"] = [{k: v for k, v in r.items() if k not in series} for r in document["results"]]
    return json.dumps(_finite(slim), default=str, allow_nan=False)


def plot(path: str | Path, runs: Sequence[tuple[str, Sequence[RequestRecord]]]) -> None:
    """Latency CDFs (TTFT, TPOT, E2E) and output throughput over time, one line per endpoint."""
    fig = figure(runs)
    import matplotlib.pyplot as plt

    fig.savefig(str(path), dpi=100)
    plt.close(fig)


def figure(runs: Sequence[tuple[str, Sequence[RequestRecord]]]) -> Any:
    """`plot`'s figure. Each series has markers too: a run shorter than a second has one
    throughput bin, and a line through one point draws nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = (("TTFT", lambda r: r.ttft), ("TPOT", lambda r: r.tpot), ("E2E", lambda r: r.e2e))
    for ax, (name, get) in zip(axes.flat, panels, strict=False):
        for label, records in runs:
            xs = sorted(v * 1000.0 for r in records if r.ok and (v := get(r)) is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label,
                        marker=".", markersize=4)
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
    ax = axes.flat[3]
    for label, records in runs:
        series = throughput_over_time(records)
        ax.plot([p["t"] for p in series], [p["tokens_per_s"] for p in series], label=label,
                marker=".", markersize=4)
    ax.set(title="Output throughput", xlabel="time (s)", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    for a in axes.flat:
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    return fig
