"""The local backend gives up on an unusable zygote without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from sluice.control import zygote
from sluice.control.local import LocalBackend


class StuckZygote:
    """A zygote that never got ready, whose close() waits as the real one's does while
    another start's wait_ready holds its lock (found by a new-user pass: a stale kernel
    build lock held both starts, and the router's port stopped answering)."""

    released = threading.Event()
    closed = threading.Event()

    def __init__(self, env: Any, log: Path) -> None:
        self.alive = True

    def wait_ready(self, timeout: float) -> None:
        raise zygote.ZygoteError("not ready in time")

    def close(self) -> None:
        self.released.wait(10)  # bounded: the test releases it
        self.closed.set()


async def test_an_unusable_zygote_is_closed_off_the_event_loop(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(zygote, "Zygote", StuckZygote)
    monkeypatch.setattr(zygote, "supported", lambda: True)
    backend = LocalBackend(log_dir=tmp_path, zygote=True)
    giving_up = asyncio.ensure_future(backend._ready_zygote())
    ticks = 0
    for _ in range(20):  # the loop keeps running while close() waits
        await asyncio.sleep(0.01)
        ticks += 1
    assert ticks == 20 and not giving_up.done()
    StuckZygote.released.set()
    assert await asyncio.wait_for(giving_up, 10) is None
    assert StuckZygote.closed.is_set() and backend.use_zygote is False
