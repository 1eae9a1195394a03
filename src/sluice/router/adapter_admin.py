"""`/admin/adapters`: the LoRA adapters the router places on its workers (adapters.py).

    GET    /admin/adapters          [{"name", "path", "base", "pinned", "workers", "demand"}]
    POST   /admin/adapters          {"name", "path", "base"?, "pinned"?}   register (201);
                                    400 for a name a pool serves as its model, or a
                                    base no pool serves (`check_names`)
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
from sluice.protocol.errors import InvalidRequestError
from sluice.router.adapters import check_adapter_body
from sluice.router.config import ADMIN_KEY_SETTING, AdapterSpec
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
        check_names(state, spec)
        state.adapters.register(spec)
        return JSONResponse({"name": spec.name, "path": spec.path, "base": spec.base,
                             "pinned": spec.pinned}, status_code=201)

    @api.delete("/adapters/{name:path}")
    async def remove_adapter(request: Request, name: str) -> dict[str, Any]:
        state = router_state(request)
        await state.adapters.unregister(name)
        return {"name": name, "deleted": True}

    return api


def check_names(state: RouterState, spec: AdapterSpec) -> None:
    """An adapter's name is no model a pool serves (else that model's requests were
    placed as the adapter's: the router loaded the adapter under the model's name), and
    its base is one (else it was listed, never loaded, and each request for it was a 404
    naming the base); with several pools it must name one."""
    if not state.adapters.is_adapter(spec.name) and any(p.serves(spec.name)
                                                        for p in state.pools):
        raise InvalidRequestError(f"{spec.name!r} is a model the router serves, not a name "
                                  "for an adapter", param="name")
    if spec.base is None:
        if len(state.pools) > 1:
            raise InvalidRequestError("several models are served: name the adapter's 'base'",
                                      param="base")
    elif not any(p.serves(spec.base) for p in state.pools):
        raise InvalidRequestError(f"no pool serves the base model {spec.base!r}",
                                  param="base")
