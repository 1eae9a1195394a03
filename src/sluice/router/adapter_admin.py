"""`/admin/adapters`: the LoRA adapters the router places on its workers (adapters.py).

    GET    /admin/adapters          [{"name", "path", "base", "pinned", "workers", "demand"}]
    POST   /admin/adapters          {"name", "path", "base"?, "pinned"?}   register (201)
    DELETE /admin/adapters/{name}   unregister, and unload wherever the router loaded it

A registered adapter is loaded on demand (or everywhere, pinned), and the router
remembers its path: a restarted worker gets it back. Guarded by the router's admin key,
like /admin/workers (401 without it, 403 with none configured).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sluice.protocol.edge import check_admin_key, load_json_object
from sluice.router.adapters import check_adapter_body
from sluice.router.config import ADMIN_KEY_SETTING
from sluice.router.state import RouterState


def adapter_router() -> APIRouter:
    api = APIRouter(prefix="/admin")

    def router_state(request: Request) -> RouterState:
        state: RouterState = request.app.state.router
        check_admin_key(state.config.admin_key, request.headers.raw,
                        setting=ADMIN_KEY_SETTING)
        return state

    @api.get("/adapters")
    async def list_adapters(request: Request) -> dict[str, Any]:
        return {"adapters": router_state(request).adapters.describe()}

    @api.post("/adapters")
    async def add_adapter(request: Request) -> JSONResponse:
        state = router_state(request)
        spec = check_adapter_body(load_json_object(await request.body(), param="body"))
        state.adapters.register(spec)
        return JSONResponse({"name": spec.name, "path": spec.path, "base": spec.base,
                             "pinned": spec.pinned}, status_code=201)

    @api.delete("/adapters/{name:path}")
    async def remove_adapter(request: Request, name: str) -> dict[str, Any]:
        state = router_state(request)
        await state.adapters.unregister(name)
        return {"name": name, "deleted": True}

    return api
