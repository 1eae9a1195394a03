"""Admin endpoints of a pool's release (canary, pins, shadow): see release.py.

    GET /admin/pools/{pool}/release   state, weight, steps, workers per version, the
                                      window's statistics per version, the comparison
                                      (test, p-value, samples per metric), decisions
    PUT /admin/pools/{pool}/release   {"weight": 0-100}                  set the weight
                                      {"action": "start" | "pause" | "resume" |
                                                 "rollback" | "promote"}  by hand

`{pool}` is the pool's model name or any name it serves. A PUT answers like the GET.
Guarded by the router's admin key, like /admin/workers.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from sluice.protocol.edge import check_admin_key
from sluice.protocol.errors import InvalidRequestError
from sluice.router.config import ADMIN_KEY_SETTING
from sluice.router.release import Release, Releases


class ReleaseChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight: float | None = None
    action: Literal["start", "pause", "resume", "rollback", "promote"] | None = None


def _release(request: Request, pool: str) -> Release:
    key: str | None = request.app.state.router.config.admin_key
    check_admin_key(key, request.headers.raw, setting=ADMIN_KEY_SETTING)
    releases: Releases = request.app.state.router.releases
    return releases.find(pool)


def _change(raw: bytes) -> ReleaseChange:
    try:
        change = ReleaseChange.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        errors = exc.errors()
        param = ".".join(str(x) for x in errors[0]["loc"]) if errors else None
        raise InvalidRequestError(f"invalid release change: {exc}", param=param) from exc
    if change.weight is None and change.action is None:
        raise InvalidRequestError("give 'weight' or 'action'", param="action")
    return change


def release_router() -> APIRouter:
    api = APIRouter(prefix="/admin")

    @api.get("/pools/{pool:path}/release")
    async def get_release(request: Request, pool: str) -> dict[str, Any]:
        return _release(request, pool).describe()

    @api.put("/pools/{pool:path}/release")
    async def put_release(request: Request, pool: str) -> dict[str, Any]:
        release = _release(request, pool)
        change = _change(await request.body())
        if change.weight is not None:
            release.set_weight(change.weight)
        if change.action == "start":
            release.start()
        elif change.action == "pause":
            release.pause()
        elif change.action == "resume":
            release.resume()
        elif change.action == "rollback":
            release.rollback("manual", "rolled back by hand")
        elif change.action == "promote":
            release.promote("promoted by hand")
        return release.describe()

    return api
