"""`sluice top`: the status page in a terminal, for a server without a browser.

    sluice top [--url http://127.0.0.1:8000] [--admin-key KEY] [--interval 1] [--once]

Polls the router's `/status.json` (the same snapshot the `/status` page draws) and
redraws with rich: totals, one row per worker (health, load, KV usage, prefix hit rate,
TTFT / ITL p50 and p99, request rate), responses by status, tenants (with the admin
key) and the latest errors. `--once` prints one frame and exits (scripts, tests).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("top", help="a live terminal view of a running sluice router",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the router or `sluice serve` base URL (default: %(default)s)")
    p.add_argument("--admin-key", default=None, help="show per-tenant usage (the admin key)")
    p.add_argument("--interval", type=_seconds, default=1.0,
                   help="seconds between refreshes (default %(default)s)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(func=handler)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


class NotAStatus(Exception):
    """The URL answered, but not with a sluice /status.json snapshot."""


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.1f}%"


def _num(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _health(w: dict[str, Any]) -> Text:
    if not w.get("reachable", True):
        return Text("unreachable", style="red")
    if not w.get("healthy"):
        return Text("ejected", style="red")
    return Text("draining", style="yellow") if w.get("draining") else Text("healthy", "green")


def workers_table(snap: dict[str, Any]) -> Table:
    table = Table(title="workers", expand=True)
    for name in ("worker", "health", "in flight", "running", "waiting", "KV", "hit",
                 "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "req/s"):
        table.add_column(name, justify="left" if name == "worker" else "right")
    for w in snap["workers"]:
        table.add_row(w["url"], _health(w), _num(w.get("inflight")), _num(w.get("running")),
                      _num(w.get("waiting")), _pct(w.get("kv_usage")), _pct(w.get("hit_rate")),
                      _ms(w.get("ttft_p50")), _ms(w.get("ttft_p99")), _ms(w.get("itl_p50")),
                      _ms(w.get("itl_p99")), _num(w.get("requests_per_s"), 2))
    return table


def render(snap: dict[str, Any], admin_key_sent: bool = False) -> Group:
    """One frame of the view from a /status.json snapshot (`admin_key_sent`: a snapshot
    without tenants says the key was refused)."""
    t = snap["totals"]
    served = sum(snap["responses"].values())
    head = Text.assemble(
        ("sluice ", "bold"), f"workers {t['healthy']}/{t['workers']}  ",
        f"running {t['running']:.0f}  waiting {t['waiting']:.0f}  ",
        f"req/s {t['requests_per_s']:.2f}  tok/s {t['tokens_per_s']:.1f}  served {served:.0f}  ",
        (time.strftime("%H:%M:%S", time.localtime(snap["time"])), "dim"))
    parts: list[Any] = [Panel(head), workers_table(snap)]
    responses = Table(title="responses by status")
    responses.add_column("status")
    responses.add_column("count", justify="right")
    for status, count in sorted(snap["responses"].items()):
        responses.add_row(status, f"{count:.0f}")
    parts.append(responses)
    if snap.get("tenants") is not None:
        tenants = Table(title="tenants")
        for name in ("tenant", "requests", "tokens", "spend (USD)"):
            tenants.add_column(name, justify="left" if name == "tenant" else "right")
        for r in snap["tenants"]:
            tenants.add_row(r["tenant"], f"{r['requests']:.0f}", f"{r['tokens']:.0f}",
                            f"{r['spend_usd']:.6f}")
        parts.append(tenants)
    elif admin_key_sent:
        parts.append(Text("tenants: the admin key was not accepted", style="yellow"))
    for e in snap["errors"][-5:]:
        parts.append(Text(f"{time.strftime('%H:%M:%S', time.localtime(e['time']))} "
                          f"{e['level']} {e['message']}", style="red"))
    return Group(*parts)


def fetch(client: httpx.Client, url: str, key: str | None) -> dict[str, Any]:
    headers = {"x-admin-key": key} if key else {}
    resp = client.get(url.rstrip("/") + "/status.json", headers=headers)
    resp.raise_for_status()
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict) or not _SNAPSHOT_KEYS <= data.keys():
        raise NotAStatus(f"{resp.url} is not a sluice status snapshot (is --url a sluice "
                         "router or `sluice serve`?)")
    return data


_SNAPSHOT_KEYS = {"time", "totals", "workers", "responses", "errors"}


# piped (`--once` in a script, `> file`): rich's default of 80 columns cut each worker's
# URL to "htt…" and its health to "hea…"; a row needs about 140
PIPED_WIDTH = 160


def handler(args: argparse.Namespace) -> int:
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, PIPED_WIDTH)
    with httpx.Client(timeout=5.0) as client:
        try:
            if args.once:
                console.print(render(fetch(client, args.url, args.admin_key),
                                     bool(args.admin_key)))
                return 0
            with Live(console=console, auto_refresh=False, screen=False) as live:
                while True:
                    snap = fetch(client, args.url, args.admin_key)
                    live.update(render(snap, bool(args.admin_key)), refresh=True)
                    time.sleep(args.interval)
        except httpx.HTTPError as exc:
            print(f"sluice top: cannot read {args.url}/status.json: {exc}", file=sys.stderr)
            return 1
        except NotAStatus as exc:
            print(f"sluice top: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
