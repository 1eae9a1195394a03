"""Every environment variable sluice reads, in one place, all prefixed `SLUICE_`."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Where sluice keeps local state (SQLite database, dev key): SLUICE_HOME or ./.sluice."""
    return Path(os.environ.get("SLUICE_HOME", ".sluice"))


def get(name: str, default: str | None = None) -> str | None:
    """Read SLUICE_<NAME>; `name` is given without the prefix."""
    return os.environ.get(f"SLUICE_{name}", default)


def otel(name: str) -> str | None:
    """Read OTEL_<NAME>, OpenTelemetry's standard variables (not SLUICE_-prefixed: the
    OpenTelemetry SDK and every collector already use these names)."""
    return os.environ.get(f"OTEL_{name}")
