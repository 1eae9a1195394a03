"""`GET|POST /admin/pools/{pool}/model`: a pool's model version and its blue/green swap.

    GET  /admin/pools/{pool}/model   {"pool", "revision", "model": {"model", "options"},
                                      "workers": [{"url", "revision", "draining"}],
                                      "swap": {"revision", "state", "error", ...} | null}
    POST /admin/pools/{pool}/model   {"model": PATH, <sluice worker flags>...}
                                     202, the same view with the swap `starting`

The router does not import the control plane: whoever runs the pool's controller in
this process (`control.controller.attach`) passes a function that finds it for a pool;
the controller parses the body and runs the swap (`control/swap.py`). Guarded by the
router's admin key, like /admin/workers (401 without it, 403 with none configured).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sluice.protocol.edge import check_admin_key
from sluice.protocol.errors import NotFoundError
from sluice.router.config import ADMIN_KEY_SETTING
from sluice.router.pool import Pool
from sluice.router.state import RouterState


class ModelSwapper(Protocol):
    def model_view(self) -> dict[str, Any]: ...

    def swap_model(self, body: bytes) -> dict[str, Any]: ...


def model_router(find: Callable[[Pool], ModelSwapper | None]) -> APIRouter:
    api = APIRouter(prefix="/admin")

    def swapper(request: Request, name: str) -> ModelSwapper:
        state: RouterState = request.app.state.router
        check_admin_key(state.config.admin_key, request.headers.raw,
                        setting=ADMIN_KEY_SETTING)
        found = find(state.resolve(name))
        if found is None:
            raise NotFoundError(f"pool {name!r} has no controller in this router",
                                param="pool", code="pool_not_controlled")
        return found

    @api.get("/pools/{pool:path}/model")
    async def get_model(request: Request, pool: str) -> dict[str, Any]:
        return swapper(request, pool).model_view()

    @api.post("/pools/{pool:path}/model")
    async def swap_model(request: Request, pool: str) -> JSONResponse:
        found = swapper(request, pool)
        return JSONResponse(found.swap_model(await request.body()), status_code=202)

    return api
