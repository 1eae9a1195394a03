"""Prefill/decode disaggregation on the worker (docs/pd.md): vLLM's `kv_transfer_params`
checked and handed to the engine, the worker's P/D role with epoch fencing, metrics.

    POST /v1/completions | /v1/chat/completions  {..., "kv_transfer_params": {...}}
         do_remote_decode: a prefill (n=1, one prompt, not streamed); the response
           carries the params naming the held KV (sluice.engine.kv_transfer)
         do_remote_prefill: a decode; the engine pulls that KV first (or recomputes, or
           answers 503 kv_transfer_failed under --kv-load-failure-policy fail)
    any generation request with `x-sluice-pd-epoch: N`, N not the current epoch: 409
    GET  /v1/pd_role  -> {"role", "epoch", "draining"}
    POST /v1/pd_role  {"role", "expected_epoch", "drain_timeout"}
         409 (param expected_epoch) unless expected_epoch is the current epoch; else
         wait for in-flight requests (up to drain_timeout s), switch, epoch + 1

A role only tells the router where to send what: a worker of any role serves any
request, so a switch under load loses nothing, and the epoch fences requests a router
routed by the old role.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import Field, StrictInt

from sluice.protocol.errors import ConflictError, InvalidRequestError
from sluice.protocol.openai import OpenAIModel, SamplingFields, parse_request

if TYPE_CHECKING:
    from sluice.worker.state import WorkerState

ROLES = ("prefill", "decode", "both")
EPOCH_HEADER = "x-sluice-pd-epoch"
PARAM = "kv_transfer_params"
_HOSTNAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


@dataclass
class PDRole:
    """The worker's role and epoch (event-loop thread only)."""

    role: str = "both"
    epoch: int = 0
    draining: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "epoch": self.epoch, "draining": self.draining}


class PDRoleRequest(OpenAIModel):
    role: Literal["prefill", "decode", "both"]
    expected_epoch: StrictInt
    drain_timeout: float = Field(default=30.0, ge=0, le=3600)


# -- kv_transfer_params ------------------------------------------------------------------
def transfer_params(req: SamplingFields, num_prompts: int) -> dict[str, Any] | None:
    """The request's `kv_transfer_params` as the engine takes them, or None (absent, or
    neither flag set); a 400 naming the field for what a prefill or a decode cannot do."""
    p = req.kv_transfer_params
    if p is None or not (p.do_remote_decode or p.do_remote_prefill):
        return None
    if p.do_remote_decode and p.do_remote_prefill:
        raise InvalidRequestError("kv_transfer_params: do_remote_decode and "
                                  "do_remote_prefill cannot both be true", param=PARAM)
    if p.do_remote_decode:
        for bad, param, why in ((req.n != 1, "n", "n=1"),
                                (num_prompts != 1, "prompt", "one prompt"),
                                (req.stream, "stream", "stream: false")):
            if bad:
                raise InvalidRequestError(f"a prefill for remote decode (kv_transfer_params."
                                          f"do_remote_decode) needs {why}", param=param)
        return p.model_dump()
    for name in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host",
                 "remote_port"):
        if getattr(p, name) is None:
            raise InvalidRequestError(f"kv_transfer_params.do_remote_prefill needs "
                                      f"{name}", param=f"{PARAM}.{name}")
    if not valid_host(p.remote_host or ""):
        raise InvalidRequestError(f"kv_transfer_params.remote_host {p.remote_host!r} is not "
                                  "a host name or IP address", param=f"{PARAM}.remote_host")
    if not p.remote_port:
        raise InvalidRequestError("kv_transfer_params.remote_port must be in [1, 65535]",
                                  param=f"{PARAM}.remote_port")
    return p.model_dump()


def valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOSTNAME.fullmatch(host) is not None


# -- roles and fencing ------------------------------------------------------------------------
def check_epoch(request: Request, state: WorkerState) -> None:
    """409 `stale_pd_epoch` when the request carries an epoch that is not the worker's
    (a router that routed by a role this worker no longer has); no header: no check."""
    value = request.headers.get(EPOCH_HEADER)
    if value is None:
        return
    try:
        epoch = int(value)
    except ValueError:
        raise InvalidRequestError(f"{EPOCH_HEADER} must be an integer, got {value!r}",
                                  param=EPOCH_HEADER) from None
    if epoch != state.pd.epoch:
        raise ConflictError(f"stale P/D epoch {epoch}: this worker is at epoch "
                            f"{state.pd.epoch} (role {state.pd.role})", param=EPOCH_HEADER,
                            code="stale_pd_epoch")


async def switch_role(state: WorkerState, req: PDRoleRequest) -> dict[str, Any]:
    """Fence on `expected_epoch`, drain (bounded), switch, bump the epoch. Serialised: a
    second switch for the same epoch waits for the first, then gets its 409."""
    pd = state.pd
    async with pd.lock:
        if req.expected_epoch != pd.epoch:
            raise ConflictError(f"expected_epoch {req.expected_epoch} is stale: the worker "
                                f"is at epoch {pd.epoch} (role {pd.role})",
                                param="expected_epoch", code="stale_pd_epoch")
        pd.draining = True
        try:
            await _drain(state, req.drain_timeout)
        finally:
            pd.draining = False
        pd.role, pd.epoch = req.role, pd.epoch + 1
        return pd.as_dict()


async def _drain(state: WorkerState, timeout: float) -> None:
    """Until no generation request is in flight, or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while state.admission.active and time.monotonic() < deadline:
        await asyncio.sleep(min(0.02, max(deadline - time.monotonic(), 0)))


def add_pd_routes(app: FastAPI, state: WorkerState) -> None:
    from sluice.worker.app import parse_body

    @app.get("/v1/pd_role")
    async def get_role() -> dict[str, Any]:
        return state.pd.as_dict()

    @app.post("/v1/pd_role")
    async def post_role(request: Request) -> dict[str, Any]:
        return await switch_role(state, parse_request(PDRoleRequest, await parse_body(request)))


# -- metrics --------------------------------------------------------------------------------
class PDCollector(Collector):
    """`sluice:pd_role{role}` (1 for the current role) and `sluice:pd_epoch`."""

    def __init__(self, pd: PDRole, model_name: Any) -> None:
        self.pd = pd
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        name = self.model_name()
        role = GaugeMetricFamily("sluice:pd_role", "The worker's P/D role (1: current).",
                                 labels=["model_name", "role"])
        for r in ROLES:
            role.add_metric([name, r], 1.0 if r == self.pd.role else 0.0)
        yield role
        epoch = GaugeMetricFamily("sluice:pd_epoch", "The worker's P/D role epoch.",
                                  labels=["model_name"])
        epoch.add_metric([name], float(self.pd.epoch))
        yield epoch
