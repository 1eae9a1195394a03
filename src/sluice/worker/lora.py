"""The worker's LoRA adapters: vLLM's `--lora-modules` and runtime load/unload endpoints.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

An adapter is checked when it is registered (files, PEFT options, rank against
`--max-lora-rank`, every tensor's shape against this base model: a 400 naming what is
wrong, and the worker keeps serving); the engine core loads its weights on first use into
its host cache (`--max-cpu-loras`) and a batch slot (`--max-loras`). A request selects an
adapter by `model`; `/v1/models` lists adapters with `parent` = the base model.

Unloading only unregisters the name: requests already running with the adapter finish
with it (the core holds the weights while any sequence uses them), new requests for the
name get a 404. The registration records the adapter's content hash; if the files change
afterwards the core refuses requests for it (400) until it is loaded again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from sluice.engine.lora import LoRARequest, read_adapter
from sluice.protocol.edge import load_json_object
from sluice.protocol.errors import InvalidRequestError, NotFoundError
from sluice.protocol.openai import Acceptable, ModelCard, reject_unsupported

if TYPE_CHECKING:
    from sluice.worker.state import WorkerState


def parse_lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`--lora-modules name=path ...` -> ((name, path), ...)."""
    out: list[tuple[str, str]] = []
    for value in values or ():
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise InvalidRequestError(f"--lora-modules takes name=path, got {value!r}",
                                      param="lora_modules")
        out.append((name, path))
    return tuple(out)


class LoRARegistry:
    """Adapter name -> `LoRARequest` (event-loop thread only)."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state
        self.adapters: dict[str, LoRARequest] = {}

    def check_request(self, name: str, path: str) -> None:
        if not name or not path:
            raise InvalidRequestError("Both 'lora_name' and 'lora_path' must be provided.",
                                      param="lora_name" if not name else "lora_path")
        if name in self.adapters:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.",
                                      param="lora_name")
        if name in self.state.served_names:
            raise InvalidRequestError(f"'{name}' is the base model's name", param="lora_name")

    def validate(self, name: str, path: str) -> LoRARequest:
        """Check the adapter on disk against the engine's model (blocking: reads files)."""
        info = self.state.require_engine().inputs.info
        if not info.enable_lora:
            raise InvalidRequestError("LoRA is not enabled on this worker (--enable-lora)",
                                      param="lora_name")
        meta, _ = read_adapter(path, info.lora_shapes, info.num_layers, info.max_lora_rank)
        return LoRARequest(name, path, meta.content_hash)

    def add(self, name: str, path: str) -> LoRARequest:
        self.check_request(name, path)
        lora = self.validate(name, path)
        self.adapters[name] = lora
        return lora

    async def add_async(self, name: str, path: str) -> LoRARequest:
        self.check_request(name, path)
        lora = await anyio.to_thread.run_sync(self.validate, name, path)
        self.check_request(name, path)  # a concurrent load of the same name won
        self.adapters[name] = lora
        return lora

    def remove(self, name: str) -> None:
        if not name:
            raise InvalidRequestError("'lora_name' needs to be provided to unload a LoRA "
                                      "adapter.", param="lora_name")
        if name not in self.adapters:
            raise NotFoundError(f"The lora adapter '{name}' cannot be found.",
                                param="lora_name")
        del self.adapters[name]

    def cards(self, parent: str, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=lora.lora_path, parent=parent,
                          max_model_len=max_model_len, content_hash=lora.content_hash or None)
                for name, lora in self.adapters.items()]


# vLLM's optional fields, taken at their defaults only: `load_inplace` reloads a loaded
# name (here: unload, then load), `lora_int_id` is the engine's own numbering.
_LOAD_UNSUPPORTED: dict[str, Acceptable] = {"load_inplace": lambda v: v is None or v is False}
_UNLOAD_UNSUPPORTED: dict[str, Acceptable] = {"lora_int_id": lambda v: v is None}


def _body(raw: bytes, fields: tuple[str, ...], unsupported: dict[str, Acceptable]
          ) -> dict[str, Any]:
    """The JSON object of a load/unload request; a field it does not know, or one it
    does not implement, is a 400 naming it."""
    body = reject_unsupported(load_json_object(raw, param="body"), unsupported)
    for name in body:
        if name not in fields:
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name}",
                                      param=name)
    return body


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidRequestError(f"'{name}' must be a string", param=name)
    return value


def add_lora_routes(app: FastAPI, state: WorkerState) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = _body(await request.body(), ("lora_name", "lora_path"), _LOAD_UNSUPPORTED)
        name = _field(body, "lora_name")
        await state.loras.add_async(name, _field(body, "lora_path"))
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = _body(await request.body(), ("lora_name",), _UNLOAD_UNSUPPORTED)
        name = _field(body, "lora_name")
        state.loras.remove(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.",
                        status_code=200)
