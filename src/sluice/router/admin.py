"""Admin endpoints: list, add, remove and drain workers at runtime.

    GET    /admin/workers              every worker with its health and load
    POST   /admin/workers              {"url", "model"?, "kv_events"?, "group"?,
                                        "version"?, "role"?}                     add
    DELETE /admin/workers              {"url"} (or ?url=)                          remove
    POST   /admin/workers/drain        {"url", "drain": true|false}                drain
    GET    /admin/pools/{model}/admission   the pool's admission settings and queue
    PUT    /admin/pools/{model}/admission   change them (fields given are replaced)

A draining worker gets no new requests; its in-flight ones finish. Every call must carry
the router's admin key (`Authorization: Bearer KEY` or `X-Admin-Key`): 401 without it;
a router configured without a key answers 403 (admin closed: anyone who can reach the
port could otherwise redirect traffic).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from sluice.protocol.edge import check_admin_key
from sluice.protocol.errors import InvalidRequestError
from sluice.router.config import ADMIN_KEY_SETTING, BASELINE, SHORT, BandLimits, WorkerSpec
from sluice.router.endpoints import Endpoint
from sluice.router.state import RouterState


class AddWorker(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    model: str | None = None
    kv_events: str | None = None
    group: str = SHORT
    version: str = BASELINE  # or canary, shadow (release.py)
    role: str | None = None  # prefill, decode, both (a disaggregated pool: pd.py)


class WorkerRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str
    drain: bool = True


class BandBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    capacity: int
    timeout_s: float


class AdmissionUpdate(BaseModel):
    """PUT /admin/pools/{model}/admission: each field given replaces the current one."""

    model_config = ConfigDict(extra="forbid")
    max_inflight_per_worker: int | None = None
    max_predicted_wait_s: float | None = None
    default_band: BandBody | None = None
    bands: dict[int, BandBody] | None = None
    tenant_weights: dict[str, float] | None = None

    def changes(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.model_dump(exclude_unset=True).items()
                               if k not in ("default_band", "bands")}
        if self.default_band is not None:
            out["default_band"] = BandLimits(**self.default_band.model_dump())
        if self.bands is not None:
            out["bands"] = {p: BandLimits(**b.model_dump()) for p, b in self.bands.items()}
        return out


def describe(endpoint: Endpoint, role: str | None = None) -> dict[str, Any]:
    """One worker as the admin API and the status page show it; `role`: its P/D role
    (`RouterState.pd_role`)."""
    s = endpoint.stats()
    return {
        "url": endpoint.url, "models": list(endpoint.models), "group": endpoint.spec.group,
        "version": endpoint.spec.version, "role": role,
        "kv_events": endpoint.spec.kv_events, "healthy": endpoint.healthy,
        "draining": endpoint.draining, "inflight": endpoint.inflight,
        "running": s.running, "waiting": s.waiting, "kv_usage": s.kv_usage,
        "seconds_per_token": endpoint.seconds_per_token, "overhead_s": s.overhead_s,
    }


def _check_key(request: Request) -> None:
    key: str | None = request.app.state.router.config.admin_key
    check_admin_key(key, request.headers.raw, setting=ADMIN_KEY_SETTING)


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        errors = exc.errors()
        param = ".".join(str(x) for x in errors[0]["loc"]) if errors else None
        raise InvalidRequestError(f"invalid admin request: {exc}", param=param) from exc


def admin_router() -> APIRouter:
    api = APIRouter(prefix="/admin")

    @api.get("/workers")
    async def list_workers(request: Request) -> dict[str, Any]:
        _check_key(request)
        state: RouterState = request.app.state.router
        return {"pools": [{"models": pool.names(), "policy": pool.policy.name,
                           "workers": [describe(e, state.pd_role(pool, e))
                                       for e in pool.endpoints.values()]}
                          for pool in state.pools]}

    @api.post("/workers", status_code=201)
    async def add_worker(request: Request) -> dict[str, Any]:
        _check_key(request)
        body: AddWorker = _parse(AddWorker, await request.body())
        spec = WorkerSpec(url=body.url, kv_events=body.kv_events, group=body.group,
                          version=body.version, role=body.role)
        state: RouterState = request.app.state.router
        endpoint = await state.add_worker(spec, body.model)
        return describe(endpoint, state.pd_role(state.find_endpoint(endpoint.url)[0], endpoint))

    @api.delete("/workers")
    async def remove_worker(request: Request) -> dict[str, Any]:
        _check_key(request)
        raw = await request.body()
        url = request.query_params.get("url") or _parse(WorkerRef, raw).url
        endpoint = await request.app.state.router.remove_worker(url)
        return {"removed": endpoint.url}

    @api.post("/workers/drain")
    async def drain_worker(request: Request) -> dict[str, Any]:
        _check_key(request)
        ref: WorkerRef = _parse(WorkerRef, await request.body())
        state: RouterState = request.app.state.router
        pool, endpoint = state.find_endpoint(ref.url)
        endpoint.draining = ref.drain
        return describe(endpoint, state.pd_role(pool, endpoint))

    @api.get("/pools/{model:path}/admission")
    async def get_admission(request: Request, model: str) -> dict[str, Any]:
        _check_key(request)
        state: RouterState = request.app.state.router
        return state.admission.describe(state.resolve(model))

    @api.put("/pools/{model:path}/admission")
    async def put_admission(request: Request, model: str) -> dict[str, Any]:
        _check_key(request)
        state: RouterState = request.app.state.router
        pool = state.resolve(model)
        update: AdmissionUpdate = _parse(AdmissionUpdate, await request.body())
        config = replace(state.admission.queue(pool).config, **update.changes())
        state.admission.reconfigure(pool, config)
        return state.admission.describe(pool)

    return api
