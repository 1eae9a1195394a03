"""`sluice gateway`, `sluice keys`, `sluice tenants`, `sluice usage`.

The management commands work directly on the gateway's database (`--database-url`,
else `SLUICE_DATABASE_URL`, else SQLite at `$SLUICE_HOME/sluice.db`), so they need no
running gateway. `sluice gateway --upstream URL` runs the gateway as its own process
in front of a remote router or worker; `sluice gateway purge --older-than DAYS`
applies the retention policy to the usage ledger.

Every parsed flag is checked by argparse through a `type=` function below (times,
counts, dollars, days, the port, the price file), so a bad value is argparse's usage
error naming the flag, exit status 2, never a traceback or a silently odd value.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from sluice import env
from sluice.gateway.config import PRIORITY_CLASSES
from sluice.gateway.flags import add_gateway_arguments, gateway_config
from sluice.gateway.pricing import PriceTable
from sluice.gateway.store import (
    MAX_USAGE_ROWS,
    KeySettings,
    SQLStore,
    TenantSettings,
    UsageQuery,
    parse_time,
)
from sluice.observe.cli import add_observe_arguments, buckets
from sluice.protocol.edge import check_listen
from sluice.protocol.errors import SluiceError

_LIMIT_FLAGS = (("--rpm", "requests per minute"), ("--tpm", "tokens per minute"),
                ("--max-concurrent", "concurrent requests"))


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    _register_gateway(subparsers)
    _register_keys(subparsers)
    _register_tenants(subparsers)
    _register_usage(subparsers)


def _db_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", default=None,
                   help="SQLAlchemy URL (default: SLUICE_DATABASE_URL, else SQLite at "
                        "$SLUICE_HOME/sluice.db)")


def _limit_flags(p: argparse.ArgumentParser, with_models: bool = True) -> None:
    for flag, what in _LIMIT_FLAGS:
        p.add_argument(flag, type=count, default=None,
                       help=f"limit: {what} ('none': no limit, on update lifts it)")
    if with_models:
        p.add_argument("--allowed-models", type=models, default=None,
                       help="comma-separated model names this principal may use "
                            "('none': any model, on update lifts the list)")
    p.add_argument("--priority-class", choices=sorted(PRIORITY_CLASSES), default=None,
                   help="priority class (interactive=0, standard=1, batch=2; lower runs first)")


def _register_gateway(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("gateway", help="run the API gateway in front of an upstream, or purge",
                       description="Run the gateway (keys, limits, budgets, ledger) as its own "
                                   "process in front of --upstream.")
    p.add_argument("--upstream", help="base URL of the router or worker, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8080)
    add_gateway_arguments(p)
    p.add_argument("--admin-key", default=None, help="admin API key (default: SLUICE_ADMIN_KEY)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer source for prompt counting (default: the default model's)")
    add_observe_arguments(p)
    p.set_defaults(func=run_gateway)
    actions = p.add_subparsers(dest="gateway_action", metavar="ACTION")
    purge = actions.add_parser("purge", help="delete usage records older than DAYS")
    purge.add_argument("--older-than", type=days, required=True, metavar="DAYS")
    _db_flag(purge)
    purge.set_defaults(func=run_purge)


def _register_keys(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("keys", help="create, list and revoke API keys")
    actions = p.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="mint a key (printed once)")
    create.add_argument("--tenant", required=True, help="tenant id or name")
    create.add_argument("--name", default="", help="a label for the key")
    _limit_flags(create)
    _db_flag(create)
    create.set_defaults(func=keys_create)
    listing = actions.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--tenant", default=None)
    listing.add_argument("--json", action="store_true")
    _db_flag(listing)
    listing.set_defaults(func=keys_list)
    update = actions.add_parser("update", help="change a key's limits, models, class or "
                                               "name by id (effective at once)")
    update.add_argument("key_id")
    update.add_argument("--name", default=None, help="a new label for the key")
    _limit_flags(update)
    _db_flag(update)
    update.set_defaults(func=keys_update)
    revoke = actions.add_parser("revoke", help="revoke a key by id (effective at once)")
    revoke.add_argument("key_id")
    _db_flag(revoke)
    revoke.set_defaults(func=keys_revoke)


def _tenant_flags(p: argparse.ArgumentParser) -> None:
    _limit_flags(p)
    p.add_argument("--budget-usd", type=dollars, default=None,
                   help="hard budget in USD ('none': no budget, on update lifts it)")
    p.add_argument("--soft-budget-usd", type=dollars, default=None,
                   help="soft budget in USD (only a metric; 'none' lifts it)")
    p.add_argument("--store-bodies", choices=("yes", "no"), default=None,
                   help="store redacted prompt/completion bodies in the audit log")


def _register_tenants(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("tenants", help="create, list, update and delete tenants")
    actions = p.add_subparsers(dest="tenants_action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a tenant")
    create.add_argument("name")
    _tenant_flags(create)
    _db_flag(create)
    create.set_defaults(func=tenants_create)
    listing = actions.add_parser("list", help="list tenants with their spend")
    listing.add_argument("--json", action="store_true")
    _db_flag(listing)
    listing.set_defaults(func=tenants_list)
    update = actions.add_parser("update", help="change a tenant's settings")
    update.add_argument("name", help="tenant id or name")
    _tenant_flags(update)
    _db_flag(update)
    update.set_defaults(func=tenants_update)
    delete = actions.add_parser("delete", help="delete a tenant: revoke all its keys (at "
                                               "once); its usage records are kept")
    delete.add_argument("name", help="tenant id or name")
    _db_flag(delete)
    delete.set_defaults(func=tenants_delete)
    reset = actions.add_parser("reset-spend", help="set a tenant's spend back to 0 (a new "
                                                   "budget period; run it from cron)")
    reset.add_argument("name", help="tenant id or name")
    _db_flag(reset)
    reset.set_defaults(func=tenants_reset_spend)


def _register_usage(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("usage", help="query the usage ledger")
    p.add_argument("--tenant", default=None, help="tenant id or name")
    p.add_argument("--key", default=None, help="key id")
    p.add_argument("--since", type=moment, default=None,
                   help="epoch seconds, ISO 8601, or an age like 24h/7d")
    p.add_argument("--until", type=moment, default=None, help="same forms as --since")
    p.add_argument("--limit", type=rows, default=1000,
                   help=f"at most this many records, 1-{MAX_USAGE_ROWS} (default 1000)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    _db_flag(p)
    p.set_defaults(func=usage)


# -- helpers ----------------------------------------------------------------------------


def open_store(args: argparse.Namespace) -> SQLStore:
    return SQLStore(args.database_url or env.get("DATABASE_URL"))


# -- argparse types: a bad value is a usage error naming the flag (exit status 2) ---------


def moment(text: str) -> float:
    try:
        value = parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert value is not None
    return value


def _integer(text: str, low: int, high: int | None, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


class _Lifted:
    """The value of a limit or budget flag given as `none`: the setting is removed."""


LIFTED = _Lifted()


def _lifted(text: str) -> bool:
    return text.strip().lower() == "none"


def count(text: str) -> int | _Lifted:
    """A limit: a whole number >= 0, or `none` (no limit: `tenants update --rpm none`
    lifts one; before, a limit or budget once set could not be removed from here)."""
    return LIFTED if _lifted(text) else _integer(text, 0, None, "a whole number >= 0 or 'none'")


def rows(text: str) -> int:
    return _integer(text, 1, MAX_USAGE_ROWS, f"a whole number from 1 to {MAX_USAGE_ROWS}")


def port(text: str) -> int:
    return _integer(text, 0, 65535, "a TCP port (0-65535)")


def _number(text: str, *, positive: bool, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def dollars(text: str) -> float | _Lifted:
    return LIFTED if _lifted(text) else _number(text, positive=False,
                                                what="an amount in USD >= 0 or 'none'")


def days(text: str) -> float:
    return _number(text, positive=True, what="a number of days > 0")


def price_file(text: str) -> Path:
    """A price table that loads (read here once, so a typo fails before the server starts)."""
    try:
        PriceTable.load(text)
    except Exception as exc:  # unreadable, not JSON/YAML, the wrong shape: not a table
        detail = exc.message if isinstance(exc, SluiceError) else str(exc)
        raise argparse.ArgumentTypeError(f"cannot read the price table {text!r}: "
                                         f"{detail}") from None
    return Path(text)


def models(text: str) -> tuple[str, ...] | _Lifted:
    """Comma-separated model names, or `none` (any model: `tenants update
    --allowed-models none` lifts the list; it allowed one model named "none"). A value
    naming no model was ignored; it is a usage error."""
    if _lifted(text):
        return LIFTED
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no model: give comma-separated "
                                         "model names, or 'none' for any model")
    return names


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    out = {"rpm": args.rpm, "tpm": args.tpm, "max_concurrent": args.max_concurrent,
           "allowed_models": args.allowed_models, "priority_class": args.priority_class}
    for name in ("budget_usd", "soft_budget_usd"):
        if hasattr(args, name):
            out[name] = getattr(args, name)
    if getattr(args, "store_bodies", None) is not None:
        out["store_bodies"] = args.store_bodies == "yes"
    return {k: None if v is LIFTED else v for k, v in out.items() if v is not None}


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _guard(fn: Any) -> Any:
    """Report SluiceErrors, and the database's own errors (unreachable, a URL naming no
    driver: they were a 100-line traceback), as one line on stderr with exit code 1."""
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return int(fn(args) or 0)
        except SluiceError as exc:
            print(f"error: {exc.message}", file=sys.stderr)
            return 1
        except sa.exc.SQLAlchemyError as exc:
            cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) else exc
            detail = " ".join(str(cause).split("\n")[0].split())
            print(f"error: the gateway database: {type(cause).__name__}: {detail}",
                  file=sys.stderr)
            return 1
    wrapper.__name__ = fn.__name__
    return wrapper


# -- commands ---------------------------------------------------------------------------


@_guard
def tenants_create(args: argparse.Namespace) -> int:
    store = open_store(args)
    tenant = store.create_tenant(args.name, TenantSettings(**_limits(args)))
    print(f"created tenant {tenant.name} ({tenant.id})")
    return 0


@_guard
def tenants_update(args: argparse.Namespace) -> int:
    tenant = open_store(args).update_tenant(args.name, _limits(args))
    print(f"updated tenant {tenant.name}: {json.dumps(asdict(tenant.settings))}")
    return 0


@_guard
def tenants_delete(args: argparse.Namespace) -> int:
    tenant, revoked = open_store(args).delete_tenant(args.name)
    print(f"deleted tenant {tenant.name} ({tenant.id}): revoked {len(revoked)} key(s); "
          "its usage records are kept")
    return 0


@_guard
def tenants_reset_spend(args: argparse.Namespace) -> int:
    tenant = open_store(args).reset_spend(args.name)
    print(f"reset the spend of tenant {tenant.name} to 0")
    return 0


@_guard
def tenants_list(args: argparse.Namespace) -> int:
    rows = [{"id": t.id, "name": t.name, "spend_usd": round(t.spend_usd, 6),
             "reserved_usd": round(t.reserved_usd, 6), **asdict(t.settings)}
            for t in open_store(args).list_tenants()]
    if args.json:
        print(json.dumps(rows))
    else:
        print(_table(rows, ["id", "name", "priority_class", "rpm", "tpm", "max_concurrent",
                            "budget_usd", "spend_usd"]))
    return 0


@_guard
def keys_create(args: argparse.Namespace) -> int:
    key, plaintext = open_store(args).create_key(
        args.tenant, KeySettings(name=args.name, **_limits(args)))
    print(f"created key {key.id} for tenant {key.tenant_id} (shown once, store it now):",
          file=sys.stderr)
    print(plaintext)
    return 0


@_guard
def keys_list(args: argparse.Namespace) -> int:
    store = open_store(args)
    tenant_id = store.get_tenant(args.tenant, deleted=True).id if args.tenant else None
    rows = [{"id": k.id, "tenant_id": k.tenant_id, "display": k.display,
             "revoked": k.revoked_at is not None, **asdict(k.settings)}
            for k in store.list_keys(tenant_id)]
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:  # as --allowed-models takes them: m1,m2 (None: any model)
            if row["allowed_models"] is not None:
                row["allowed_models"] = ",".join(row["allowed_models"])
        print(_table(rows, ["id", "tenant_id", "name", "display", "priority_class", "rpm",
                            "tpm", "max_concurrent", "allowed_models", "revoked"]))
    return 0


@_guard
def keys_update(args: argparse.Namespace) -> int:
    changes = _limits(args)
    if args.name is not None:
        changes["name"] = args.name
    key = open_store(args).update_key(args.key_id, changes)
    print(f"updated key {key.id}: {json.dumps(asdict(key.settings))}")
    return 0


@_guard
def keys_revoke(args: argparse.Namespace) -> int:
    key = open_store(args).revoke_key(args.key_id)
    print(f"revoked key {key.id}")
    return 0


@_guard
def usage(args: argparse.Namespace) -> int:
    store = open_store(args)
    tenant_id = store.get_tenant(args.tenant, deleted=True).id if args.tenant else None
    query = UsageQuery(tenant_id, args.key, args.since, args.until, args.limit)
    records = store.query_usage(query)
    totals = asdict(store.usage_totals(query))  # every matching record, not only --limit
    if args.json:
        print(json.dumps({"data": [asdict(r) for r in records], "totals": totals,
                          "has_more": totals["requests"] > len(records)}))
        return 0
    rows = [{**asdict(r), "time": datetime.fromtimestamp(r.ts).isoformat(timespec="seconds"),
             "latency_ms": round(r.latency_ms, 1)} for r in records]
    print(_table(rows, ["time", "tenant_id", "key_id", "endpoint", "model", "status",
                        "prompt_tokens", "completion_tokens", "cost_usd", "latency_ms"]))
    shown = f" ({len(records)} shown, --limit {args.limit})" if totals["requests"] > len(records) else ""
    print(f"total: {json.dumps(totals)}{shown}")
    return 0


@_guard
def run_purge(args: argparse.Namespace) -> int:
    deleted = open_store(args).purge(time.time() - args.older_than * 86400)
    print(f"deleted {deleted} usage records older than {args.older_than:g} days")
    return 0


@_guard
def run_gateway(args: argparse.Namespace) -> int:
    if not args.upstream:
        print("error: --upstream URL is required to run the gateway", file=sys.stderr)
        return 2
    try:
        check_listen(args.host, args.port)  # a busy port: as serve and worker say it
    except SluiceError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2
    import uvicorn

    from sluice.gateway.middleware import GatewayMiddleware
    from sluice.gateway.proxy import UpstreamProxy
    from sluice.gateway.state import GatewayState
    from sluice.gateway.tokens import PromptTokenCounter

    config = gateway_config(args)
    state = GatewayState.from_config(
        config, count_prompt_tokens=PromptTokenCounter(default_source=args.tokenizer),
        buckets=buckets(args))
    from sluice.observe.asgi import traced_gateway
    from sluice.observe.cli import tracing_config
    from sluice.observe.tracing import start_tracing

    def wrap(upstream: Any) -> Any:
        return GatewayMiddleware(upstream, state)

    tracing = start_tracing(tracing_config(args, "sluice-gateway"))
    app = (traced_gateway(wrap, tracing) if tracing else wrap)(UpstreamProxy(args.upstream))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
