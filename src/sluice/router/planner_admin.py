"""`GET /admin/planner`: the autoscaler's view, served by the router that hosts it.

    {"pools": [{"pool", "backend", "desired", "live", "workers", "draining", "starting",
                "config": {...}, "decisions": [{"at", "previous", "desired", "reason",
                "signals": {...}, "current": {...}, "predicted": {...}}, ...],
                "events": [{"at", "event": start|ready|drain|stopped|dead|start_failed,
                            "worker", ...}, ...]}]}

The router does not import the control plane: whoever runs a planner in this process
(`sluice serve`, through `control.controller.attach`) passes a function returning this
document. Guarded by the router's admin key, like /admin/workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request

from sluice.protocol.edge import check_admin_key
from sluice.router.config import ADMIN_KEY_SETTING


def planner_router(view: Callable[[], dict[str, Any]]) -> APIRouter:
    api = APIRouter(prefix="/admin")

    @api.get("/planner")
    async def planner(request: Request) -> dict[str, Any]:
        key: str | None = request.app.state.router.config.admin_key
        check_admin_key(key, request.headers.raw,
                        setting=ADMIN_KEY_SETTING)
        return view()

    return api
