"""The gateway's own HTTP routes: `/admin/...` (admin key) and `/v1/usage` (tenant key).

Admin routes manage tenants and keys and read any tenant's usage; they require
`Authorization: Bearer <admin key>` (`SLUICE_ADMIN_KEY`), and are disabled (403) when
no admin key is configured. `/v1/usage` lets an API key read its **own tenant's**
usage only: the tenant is taken from the key, never from the query.

    POST   /admin/tenants               create        {name, rpm, tpm, ...}
    GET    /admin/tenants               list
    GET    /admin/tenants/{ref}         one (id or name)
    PATCH  /admin/tenants/{ref}         update settings
    DELETE /admin/tenants/{ref}         delete: its keys revoked, its usage records kept
    POST   /admin/tenants/{ref}/reset_spend   spend back to 0 (a new budget period)
    POST   /admin/keys                  create        {tenant, name, rpm, ...} -> key shown once
    GET    /admin/keys?tenant=          list (no secrets)
    GET    /admin/keys/{id}             one key's settings and state (no secret)
    PATCH  /admin/keys/{id}             update settings (limits, models, class, name)
    DELETE /admin/keys/{id}             revoke (also POST /admin/keys/{id}/revoke)
    GET    /admin/usage?tenant=&key=&since=&until=&limit=
    POST   /admin/purge                 {older_than_days}
    GET    /v1/usage?key=&since=&until=&limit=

`since`/`until` take what `sluice usage` takes (`store.parse_time`, the one parser:
epoch seconds, ISO 8601, an age like `24h`); anything else is a 400 naming it.

Bodies are read by `json_body`: the shared `load_json_object` (not valid JSON, not an
object: a 400 naming `body`, as on /v1), then the payload model in strict mode, so
`"rpm": true` or `"rpm": "5"` is a 400 naming `rpm` instead of a limit of 1 or 5.
A query parameter the route does not take is a 400 naming it (`only_query`), never
ignored.
While the database is unreachable every route answers 503 `store_unavailable` with
Retry-After, as the request path does.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.gateway.state import GatewayState
from sluice.gateway.store import (
    MAX_TENANT_NAME,
    OUTAGES,
    ApiKey,
    KeySettings,
    Principal,
    Store,
    Tenant,
    TenantSettings,
    UsageQuery,
    parse_time,
)
from sluice.protocol.edge import http_status_error, load_json_object
from sluice.protocol.errors import (
    AuthenticationError,
    InvalidRequestError,
    PermissionDeniedError,
    ServiceUnavailableError,
    SluiceError,
)


class _Payload(BaseModel):
    """Strict: JSON's types as they are (no `true` -> 1, no `"5"` -> 5); unknown fields
    are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


class TenantLimits(_Payload):
    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    max_concurrent: int | None = Field(None, ge=0)
    budget_usd: float | None = Field(None, ge=0, allow_inf_nan=False)
    soft_budget_usd: float | None = Field(None, ge=0, allow_inf_nan=False)
    allowed_models: list[str] | None = None


class TenantCreate(TenantLimits):
    name: str = Field(min_length=1, max_length=MAX_TENANT_NAME)
    priority_class: str = "standard"
    store_bodies: bool = False


class TenantUpdate(TenantLimits):
    priority_class: str | None = None
    store_bodies: bool | None = None


class KeyCreate(_Payload):
    tenant: str
    name: str = ""
    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    max_concurrent: int | None = Field(None, ge=0)
    allowed_models: list[str] | None = None
    priority_class: str | None = None


class KeyUpdate(_Payload):
    name: str | None = None
    rpm: int | None = Field(None, ge=0)
    tpm: int | None = Field(None, ge=0)
    max_concurrent: int | None = Field(None, ge=0)
    allowed_models: list[str] | None = None
    priority_class: str | None = None


class Purge(_Payload):
    older_than_days: float = Field(gt=0, allow_inf_nan=False)


P = TypeVar("P", bound=_Payload)


def invalid(errors: Sequence[Any]) -> InvalidRequestError:
    """Pydantic's first error as a 400 naming the field (`rpm`, `allowed_models.0`)."""
    err = errors[0] if errors else {}
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    return InvalidRequestError(f"{param}: {err.get('msg', 'invalid')}", param=param)


def json_body(model: type[P]) -> Callable[[Request], Awaitable[P]]:
    """A dependency that reads the request body as `model`: a 400 naming `body` when it
    is not a JSON object (`load_json_object`, as on /v1), else one naming the field."""
    async def parse(request: Request) -> P:
        data = load_json_object(await request.body(), param="body")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise invalid(exc.errors()) from None
    return parse


def only_query(*names: str) -> Callable[[Request], None]:
    """A dependency refusing query parameters other than `names` with a 400 naming the
    first one: `/v1/usage?start_date=...` (LiteLLM's spelling) answered every record."""
    known = frozenset(names)

    def check(request: Request) -> None:
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            raise InvalidRequestError(f"Unrecognized query parameter: {unknown[0]} (this "
                                      f"route takes {sorted(known) or 'none'})",
                                      param=unknown[0])
    return check


USAGE_QUERY = ("tenant", "key", "since", "until", "limit")


def usage_query(tenant_id: str | None, key: str | None, since: str | None,
                until: str | None, limit: int) -> UsageQuery:
    """`since`/`until` in the forms `sluice usage` takes (`parse_time`: epoch seconds,
    ISO 8601, an age like `24h`); anything else is a 400 naming the parameter."""
    times: dict[str, float | None] = {}
    for name, text in (("since", since), ("until", until)):
        try:
            times[name] = parse_time(text)
        except ValueError as exc:
            raise InvalidRequestError(f"{name}: {exc}", param=name) from None
    return UsageQuery(tenant_id, key, times["since"], times["until"], limit)


def documented(model: type[_Payload]) -> dict[str, Any]:
    """`openapi_extra` for a route whose body `json_body` reads: the app's OpenAPI
    document still describes it (tests/reliability/test_fuzz.py fuzzes from it)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": model.model_json_schema()}}}}


def tenant_json(t: Tenant) -> dict[str, Any]:
    return {"id": t.id, "name": t.name, "spend_usd": t.spend_usd,
            "reserved_usd": t.reserved_usd, "created_at": t.created_at,
            **_settings_json(t.settings)}


def key_json(k: ApiKey) -> dict[str, Any]:
    return {"id": k.id, "tenant_id": k.tenant_id, "display": k.display,
            "created_at": k.created_at, "revoked_at": k.revoked_at,
            **_settings_json(k.settings)}


def _settings_json(settings: TenantSettings | KeySettings) -> dict[str, Any]:
    data = asdict(settings)
    if data.get("allowed_models") is not None:
        data["allowed_models"] = list(data["allowed_models"])
    return data


def usage_json(store: Store, query: UsageQuery) -> dict[str, Any]:
    """The first `limit` records and the totals of *all* records the query matches
    (they summed the rows returned: the oldest 1,000 by default); `has_more` says
    whether rows were left out."""
    records = store.query_usage(query)
    totals = store.usage_totals(query)
    return {"object": "list", "data": [asdict(r) for r in records], "totals": asdict(totals),
            "has_more": totals.requests > len(records)}


def _models(values: list[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values is not None else None


def _changes(body: TenantUpdate | KeyUpdate) -> dict[str, Any]:
    """A PATCH body's fields that were sent (`null` included: it lifts a setting), the
    allowed models as the store keeps them."""
    changes = body.model_dump(exclude_unset=True)
    if "allowed_models" in changes:
        changes["allowed_models"] = _models(body.allowed_models)
    return changes


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def build_admin_app(state: GatewayState) -> FastAPI:
    """The FastAPI app for the gateway's own routes, bound to one `GatewayState`."""
    app = FastAPI(title="sluice gateway admin", docs_url=None, redoc_url=None,
                  openapi_url=None)
    store = state.store

    @app.exception_handler(SluiceError)
    async def _sluice_error(_: Request, exc: SluiceError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = http_status_error(exc.status_code, str(exc.detail), request.method,
                                  request.url.path)
        return JSONResponse(error.to_dict(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(invalid(exc.errors()).to_dict(), status_code=400)

    async def _unreachable(_: Request, exc: Exception) -> JSONResponse:
        # the database lost (refused, broken, pool exhausted): a 503 the client may retry,
        # as on the request path, instead of an unhandled driver error's 500
        error = ServiceUnavailableError("gateway database unreachable; retry shortly",
                                        code="store_unavailable")
        return JSONResponse(error.to_dict(), status_code=503, headers=error.headers)

    for outage in OUTAGES:
        app.add_exception_handler(outage, _unreachable)

    def admin(request: Request) -> None:
        state.config.check_admin(request.headers.raw)

    def caller(request: Request) -> Principal:
        principal = store.authenticate(_bearer(request) or "")
        if principal is None:
            raise AuthenticationError("invalid or revoked API key")
        return principal

    guarded = [Depends(admin), Depends(only_query())]

    @app.post("/admin/tenants", dependencies=guarded, status_code=201,
              openapi_extra=documented(TenantCreate))
    def create_tenant(body: Annotated[TenantCreate, Depends(json_body(TenantCreate))]
                      ) -> dict[str, Any]:
        data = body.model_dump(exclude={"name"})
        data["allowed_models"] = _models(body.allowed_models)
        return tenant_json(store.create_tenant(body.name, TenantSettings(**data)))

    @app.get("/admin/tenants", dependencies=guarded)
    def list_tenants() -> dict[str, Any]:
        return {"object": "list", "data": [tenant_json(t) for t in store.list_tenants()]}

    @app.get("/admin/tenants/{ref}", dependencies=guarded)
    def get_tenant(ref: str) -> dict[str, Any]:
        return tenant_json(store.get_tenant(ref))

    @app.patch("/admin/tenants/{ref}", dependencies=guarded,
               openapi_extra=documented(TenantUpdate))
    def update_tenant(ref: str, body: Annotated[TenantUpdate, Depends(json_body(TenantUpdate))]
                      ) -> dict[str, Any]:
        return tenant_json(store.update_tenant(ref, _changes(body)))

    @app.delete("/admin/tenants/{ref}", dependencies=guarded)
    def delete_tenant(ref: str) -> dict[str, Any]:
        tenant, revoked = store.delete_tenant(ref)
        return {**tenant_json(tenant), "deleted_at": tenant.deleted_at, "revoked_keys": revoked}

    @app.post("/admin/tenants/{ref}/reset_spend", dependencies=guarded)
    def reset_spend(ref: str) -> dict[str, Any]:
        return tenant_json(store.reset_spend(ref))

    @app.post("/admin/keys", dependencies=guarded, status_code=201,
              openapi_extra=documented(KeyCreate))
    def create_key(body: Annotated[KeyCreate, Depends(json_body(KeyCreate))]) -> dict[str, Any]:
        data = body.model_dump(exclude={"tenant"})
        data["allowed_models"] = _models(body.allowed_models)
        key, plaintext = store.create_key(body.tenant, KeySettings(**data))
        return {**key_json(key), "key": plaintext}

    @app.get("/admin/keys", dependencies=[Depends(admin), Depends(only_query("tenant"))])
    def list_keys(tenant: str | None = None) -> dict[str, Any]:
        tenant_id = store.get_tenant(tenant, deleted=True).id if tenant else None
        return {"object": "list", "data": [key_json(k) for k in store.list_keys(tenant_id)]}

    @app.get("/admin/keys/{key_id}", dependencies=guarded)
    def get_key(key_id: str) -> dict[str, Any]:
        return key_json(store.get_key(key_id))

    @app.patch("/admin/keys/{key_id}", dependencies=guarded,
               openapi_extra=documented(KeyUpdate))
    def update_key(key_id: str, body: Annotated[KeyUpdate, Depends(json_body(KeyUpdate))]
                   ) -> dict[str, Any]:
        changes = _changes(body)
        if changes.get("name", "") is None:
            raise InvalidRequestError("name must be a string", param="name")
        return key_json(store.update_key(key_id, changes))

    @app.delete("/admin/keys/{key_id}", dependencies=guarded)
    @app.post("/admin/keys/{key_id}/revoke", dependencies=guarded)
    def revoke_key(key_id: str) -> dict[str, Any]:
        return key_json(store.revoke_key(key_id))

    @app.get("/admin/usage", dependencies=[Depends(admin), Depends(only_query(*USAGE_QUERY))])
    def admin_usage(tenant: str | None = None, key: str | None = None,
                    since: str | None = None, until: str | None = None,
                    limit: int = 1000) -> dict[str, Any]:
        tenant_id = store.get_tenant(tenant, deleted=True).id if tenant else None
        return usage_json(store, usage_query(tenant_id, key, since, until, limit))

    @app.post("/admin/purge", dependencies=guarded, openapi_extra=documented(Purge))
    def purge(body: Annotated[Purge, Depends(json_body(Purge))]) -> dict[str, Any]:
        deleted = store.purge(time.time() - body.older_than_days * 86400)
        return {"deleted": deleted}

    @app.get("/v1/usage")
    def own_usage(principal: Principal = Depends(caller),
                  _: None = Depends(only_query(*USAGE_QUERY)), tenant: str | None = None,
                  key: str | None = None, since: str | None = None,
                  until: str | None = None, limit: int = 1000) -> dict[str, Any]:
        own = principal.tenant
        if tenant is not None and tenant not in (own.id, own.name):
            raise PermissionDeniedError("a key can only read its own tenant's usage",
                                        param="tenant")
        return usage_json(store, usage_query(own.id, key, since, until, limit))

    return app
