"""The workers of a running sluice router as a Prometheus `file_sd_configs` file.

    python -m sluice.observe.targets [--url http://127.0.0.1:8000] FILE [--interval 10] [--once]

Why: `sluice serve` starts its workers on free ports, and the controller replaces a
dead worker, or adds one when it scales, on a new port. A static scrape config names
ports that no longer answer (`SluiceTargetDown` fires for good) and misses the new
workers. Prometheus re-reads a file_sd file when it changes, so this keeps one in step
with the router's `/status.json` (the workers the status page lists):

    [{"targets": ["127.0.0.1:41233", "127.0.0.1:38411"], "labels": {}}]

`deploy/prometheus/prometheus.yml` reads it (`sluice-workers.json` beside it). The file
is replaced atomically and only when the set of workers changed; a failed poll keeps
the last file (and says so on stderr), so a restarting router does not empty it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx


def target_groups(snapshot: dict[str, Any], front: str = "") -> list[dict[str, Any]]:
    """file_sd target groups for the workers of a `/status.json` snapshot: one group,
    each worker's `host:port` once, sorted. A worker at `front` (the `host:port` polled)
    is left out: `sluice serve` with one worker lists itself, and the `sluice` job
    already scrapes that port (twice, every vllm:* sum would double)."""
    targets = sorted({urlsplit(w["url"]).netloc for w in snapshot.get("workers", [])} - {front})
    return [{"targets": targets, "labels": {}}] if targets else []


def write_if_changed(path: Path, groups: list[dict[str, Any]]) -> bool:
    """Write `groups` to `path` atomically unless it already holds them; True if written."""
    text = json.dumps(groups, indent=2) + "\n"
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return True


def sync(client: httpx.Client, url: str, path: Path) -> list[str] | None:
    """One poll: the router's workers into `path`; their targets if the file changed."""
    resp = client.get(url.rstrip("/") + "/status.json")
    resp.raise_for_status()
    groups = target_groups(resp.json(), front=urlsplit(url).netloc)
    if not write_if_changed(path, groups):
        return None
    return [t for g in groups for t in g["targets"]]


def run(client: httpx.Client, url: str, path: Path, interval_s: float, once: bool,
        sleep: Callable[[float], None] = time.sleep) -> int:
    while True:
        try:
            changed = sync(client, url, path)
            if changed is not None:
                print(f"{path}: {' '.join(changed) or 'no workers'}", file=sys.stderr)
        except (httpx.HTTPError, ValueError, OSError) as exc:  # OSError: writing the file
            print(f"{url}/status.json -> {path}: {exc} (the file is left as it was)",
                  file=sys.stderr)
            if once:
                return 1
        if once:
            return 0
        sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.observe.targets",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path, help="the file_sd JSON file to keep up to date")
    parser.add_argument("--url", default="http://127.0.0.1:8000",
                        help="the router or `sluice serve` base URL (default: %(default)s)")
    parser.add_argument("--interval", type=float, default=10.0,
                        help="seconds between polls (default %(default)s)")
    parser.add_argument("--once", action="store_true", help="write the file once and exit")
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.error(f"--interval must be > 0, got {args.interval}")
    with httpx.Client(timeout=10.0) as client:
        try:
            return run(client, args.url, args.file, args.interval, args.once)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
