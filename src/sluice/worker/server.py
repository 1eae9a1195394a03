"""Run one worker: listen at once, start the engine core beside the server, shut down
gracefully.

    start the engine core process ──▶ start uvicorn ──▶ /health 503
        ──▶ core loaded and warmed up ──▶ attach ──▶ /health 200
    SIGTERM ──▶ stop accepting ──▶ in-flight streams finish (≤ shutdown_timeout)
            ──▶ engine.shutdown() (the core process exits) ──▶ exit 0
    core process dies ──▶ open streams end with a 503 error ──▶ the server stops, exit 1

Listening before the model is ready lets a supervisor (LocalWorkerPool, Kubernetes)
tell "starting" from "dead". The engine core runs in its own process
(`AsyncEngine.spawn`), so the model's forward pass and this process's HTTP work never
wait on each other's GIL; a worker whose core died exits, and its supervisor restarts it.
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

from sluice import env
from sluice.engine.config import EngineConfig
from sluice.protocol.errors import SluiceError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

if TYPE_CHECKING:
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.core_client import ProcessCore
    from sluice.worker.state import WorkerState

log = logging.getLogger("sluice.worker")

Say = Callable[[str], None]
# Wraps the worker's ASGI app before it is served (sluice serve puts the gateway here).
Wrap = Callable[[Any], Any]


def _say(message: str) -> None:
    print(f"sluice: {message}", file=sys.stderr, flush=True)


def start_core(engine_config: EngineConfig, config: WorkerConfig) -> ProcessCore:
    """Start the engine core process; it loads the model while this process starts its
    server. Forked when `SLUICE_WORKER_MULTIPROC_METHOD=fork` (a worker forked from a
    pre-imported template: `sluice.control.zygote`), so call it before any thread starts."""
    from sluice.engine.core_client import START_METHODS, ProcessCore

    method = env.get("WORKER_MULTIPROC_METHOD") or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"SLUICE_WORKER_MULTIPROC_METHOD must be one of {START_METHODS}")
    return ProcessCore(engine_config, config.kv_events_endpoint, start_method=method)


def load_engine(engine_config: EngineConfig, core: ProcessCore) -> AsyncEngine:
    """Wait until the started core's model is loaded (blocking); the engine in front of it."""
    from sluice.engine.async_engine import AsyncEngine

    return AsyncEngine.spawn(engine_config, core=core)


async def _load_and_attach(app_state: WorkerState, engine_config: EngineConfig,
                           core: ProcessCore, server: uvicorn.Server, say: Say,
                           holder: list[AsyncEngine]) -> None:
    model = engine_config.model.model or "SmolLM2-135M-Instruct (the default GGUF)"
    say(f"loading model {model} ...")
    start = time.perf_counter()
    ticker = asyncio.create_task(_tick(say, start))
    try:
        engine = await asyncio.to_thread(load_engine, engine_config, core)
    except Exception as exc:
        param = exc.param if isinstance(exc, SluiceError) else None
        say(f"failed to start: {exc} (--{param.replace('_', '-')})"  # another setting's
            if param and param != "model" else f"failed to load the model: {exc}")
        if not isinstance(exc, SluiceError):  # a bad --model needs no traceback
            log.exception("model load failed")
        server.should_exit = True
        raise
    finally:
        ticker.cancel()
    holder.append(engine)
    loop = asyncio.get_running_loop()

    def on_death(exc: Exception) -> None:  # on the engine's output thread
        loop.call_soon_threadsafe(_stop_on_death, server, say, exc)

    engine.on_death.append(on_death)
    try:
        app_state.attach(engine)  # registers --lora-modules
    except SluiceError as exc:
        say(f"failed to start: {exc}")
        server.should_exit = True
        raise
    config = server.config
    say(f"model {engine.model_name} loaded in {time.perf_counter() - start:.1f}s "
        f"(max_model_len {engine.max_model_len})")
    say(f"listening on http://{config.host}:{_port(server)} (model: {engine.model_name})")


def _stop_on_death(server: uvicorn.Server, say: Say, exc: Exception) -> None:
    say(f"engine core died ({exc}); stopping")
    server.should_exit = True


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
    core = start_core(engine_config, config)  # first: no thread has started yet
    return asyncio.run(_serve(engine_config, config, core, say, wrap))


async def _serve(engine_config: EngineConfig, config: WorkerConfig, core: ProcessCore,
                 say: Say, wrap: Wrap | None = None) -> int:
    app = build_app(None, config)
    server = uvicorn.Server(uvicorn.Config(
        wrap(app) if wrap else app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=math.ceil(config.shutdown_timeout), access_log=False))
    holder: list[AsyncEngine] = []
    loader = asyncio.create_task(_load_and_attach(app.state.worker, engine_config, core,
                                                  server, say, holder))
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
    failed = failed or any(engine.dead is not None for engine in holder)
    say("stopped")
    return 1 if failed or not server.started else 0


def quiet_signal_reraise() -> None:
    """uvicorn re-raises the signal it caught once it has drained; make that a no-op so the
    process exits with our code (0) instead of dying by the signal."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
