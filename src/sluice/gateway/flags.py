"""The gateway's server flags, declared once for `sluice gateway` and `sluice serve`,
and read back into a `GatewayConfig` (`gateway_config`). Light to import: `sluice
serve --help` does not load the store's database layer (the price table is read by
`gateway.cli.price_file` only when `--prices` is given). `--admin-key` stays each
command's own: `sluice serve`'s also guards the router's admin API.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from sluice import env
from sluice.gateway.config import FAILURE_MODES, GatewayConfig, LimiterConfig


def _prices(text: str) -> Any:
    from sluice.gateway.cli import price_file

    return price_file(text)


def _within(low: float, high: float, unit: str) -> Callable[[str], float]:
    """An argparse type: a number of `unit` in [low, high]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {unit} in [{low:g}, {high:g}], "
                                             f"got {text!r}")
        return value

    return parse


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", default=None,
                   help="the gateway's store, a SQLAlchemy URL (default: "
                        "SLUICE_DATABASE_URL, else SQLite at $SLUICE_HOME/sluice.db; "
                        "postgresql://... for PostgreSQL)")
    p.add_argument("--redis-url", default=None,
                   help="share limit counters across gateway replicas through Redis "
                        "(default: SLUICE_REDIS_URL; unset = in process)")
    p.add_argument("--on-redis-error", choices=FAILURE_MODES, default="closed",
                   help="when Redis is unreachable: closed = 503, open = admit unlimited "
                        "(default: %(default)s)")
    p.add_argument("--prices", type=_prices, default=None,
                   help="price table (JSON/YAML: model -> input/output_per_million; "
                        "docs/gateway.md); without one every cost is 0 and budgets never bite")
    p.add_argument("--await-ledger", action="store_true",
                   help="commit every request's ledger row before its response's last "
                        "bytes (default: only a budgeted tenant's, whose next admission "
                        "reads its spend; the others just after)")
    p.add_argument("--ledger-batch-interval", type=_within(0, 10, "seconds"), default=0.02,
                   metavar="SECONDS",
                   help="the least time between two ledger commits of rows written after "
                        "their responses: fewer, larger commits (LiteLLM's "
                        "proxy_batch_write_at; default: %(default)s)")
    p.add_argument("--response-retention", type=_within(0, 36500, "days"), default=30.0,
                   metavar="DAYS",
                   help="how long the Responses API's stored responses are kept, for "
                        "previous_response_id and GET /v1/responses/{id} (OpenAI's "
                        "default: 30); 0 stores none, and then 'store' must be false "
                        "(default: %(default)s)")
    p.add_argument("--background-lease", type=_within(0.5, 3600, "seconds"), default=15.0,
                   metavar="SECONDS",
                   help="a background response's gateway replica renews it while it runs; "
                        "one not renewed this long (its replica was killed) is ended "
                        "'failed', with its ledger row, by the next read or by another "
                        "replica's sweep (every lease) (default: %(default)s)")


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    """The `GatewayConfig` those flags (and `--admin-key`) ask for, its ledger spool at
    the default place."""
    limiter = LimiterConfig(redis_url=args.redis_url or env.get("REDIS_URL"),
                            on_redis_error=args.on_redis_error)
    return GatewayConfig(database_url=args.database_url or env.get("DATABASE_URL"),
                         admin_key=args.admin_key or env.get("ADMIN_KEY"), limiter=limiter,
                         prices_file=args.prices, await_ledger=args.await_ledger,
                         ledger_batch_interval_s=args.ledger_batch_interval,
                         response_retention_s=args.response_retention * 86400,
                         background_lease_s=args.background_lease).with_spool()
