"""Run one worker: listen at once, load the model beside the server, shut down gracefully.

    start uvicorn ──▶ /health 503 ──▶ model loaded (thread) ──▶ attach ──▶ /health 200
    SIGTERM ──▶ stop accepting ──▶ in-flight streams finish (≤ shutdown_timeout)
            ──▶ engine.shutdown() ──▶ exit 0

Listening before the model is ready lets a supervisor (LocalWorkerPool, Kubernetes)
tell "starting" from "dead". The weights load on a worker thread; the AsyncEngine is
then created on the event loop's thread (it owns asyncio objects of that loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from sluice.engine.config import EngineConfig
from sluice.protocol.errors import SluiceError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

if TYPE_CHECKING:
    from sluice.engine.async_engine import AsyncEngine

log = logging.getLogger("sluice.worker")

Say = Callable[[str], None]
# Wraps the worker's ASGI app before it is served (sluice serve puts the gateway here).
Wrap = Callable[[Any], Any]


def _say(message: str) -> None:
    print(f"sluice: {message}", file=sys.stderr, flush=True)


def load_engine(engine_config: EngineConfig) -> AsyncEngine:
    """Build the AsyncEngine (blocking: reads weights, allocates the KV pool)."""
    from sluice.engine.async_engine import AsyncEngine

    return AsyncEngine(engine_config)


async def _load_and_attach(app_state: object, engine_config: EngineConfig, server: uvicorn.Server,
                           say: Say, holder: list[AsyncEngine]) -> None:
    model = engine_config.model.model or "SmolLM2-135M-Instruct (the default GGUF)"
    say(f"loading model {model} ...")
    start = time.perf_counter()
    ticker = asyncio.create_task(_tick(say, start))
    try:
        engine = await asyncio.to_thread(load_engine, engine_config)
    except Exception as exc:
        say(f"failed to load the model: {exc}")
        if not isinstance(exc, SluiceError):  # a bad --model needs no traceback
            log.exception("model load failed")
        server.should_exit = True
        raise
    finally:
        ticker.cancel()
    holder.append(engine)
    app_state.attach(engine)  # type: ignore[attr-defined]
    config = server.config
    say(f"model {engine.model_name} loaded in {time.perf_counter() - start:.1f}s "
        f"(max_model_len {engine.max_model_len})")
    say(f"listening on http://{config.host}:{_port(server)} (model: {engine.model_name})")


async def _tick(say: Say, start: float, every: float = 5.0) -> None:
    """Progress while the weights load: one line every few seconds."""
    while True:
        await asyncio.sleep(every)
        say(f"still loading the model ({time.perf_counter() - start:.0f}s)")


def _port(server: uvicorn.Server) -> int:
    for s in server.servers:
        for sock in s.sockets:
            return int(sock.getsockname()[1])
    return server.config.port


def run_worker(engine_config: EngineConfig, config: WorkerConfig, say: Say = _say,
               wrap: Wrap | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (0 after a clean drain)."""
    logging.basicConfig(level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(engine_config, config, say, wrap))


async def _serve(engine_config: EngineConfig, config: WorkerConfig, say: Say,
                 wrap: Wrap | None = None) -> int:
    app = build_app(None, config)
    server = uvicorn.Server(uvicorn.Config(
        wrap(app) if wrap else app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=math.ceil(config.shutdown_timeout), access_log=False))
    holder: list[AsyncEngine] = []
    loader = asyncio.create_task(_load_and_attach(app.state.worker, engine_config, server,
                                                  say, holder))
    quiet_signal_reraise()
    try:
        await server.serve()
    finally:
        loader.cancel()
        with contextlib.suppress(BaseException):
            await loader
        for engine in holder:
            engine.shutdown()
    failed = loader.done() and not loader.cancelled() and loader.exception() is not None
    say("stopped")
    return 1 if failed or not server.started else 0


def quiet_signal_reraise() -> None:
    """uvicorn re-raises the signal it caught once it has drained; make that a no-op so the
    process exits with our code (0) instead of dying by the signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
