"""The router's live status page: `/status` (HTML) and `/status.json` (observe/status.py).

The board is created in the app's lifespan (`open_board`) from the router's state: its
workers (`admin.describe`), their /metrics through the router's one HTTP client, and
the local registries (the router's own, plus the gateway's under `sluice serve`).
Per-tenant usage is added only for a caller with the router's admin key.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from sluice.observe.status import StatusBoard, page_html
from sluice.protocol.edge import admin_key_given
from sluice.router.admin import describe
from sluice.router.state import RouterState

LocalMetrics = Callable[[], bytes]


def open_board(state: RouterState, extra: Sequence[LocalMetrics] = ()) -> StatusBoard:
    async def fetch(url: str) -> str:
        resp = await state.client.get(url, timeout=state.config.connect_timeout_s)
        resp.raise_for_status()
        return resp.text

    def local() -> list[str]:
        return [render().decode() for render in (state.metrics.render, *extra)]

    board = StatusBoard(
        lambda: [describe(e, state.pd_role(pool, e))
                 for pool in state.pools for e in pool.endpoints.values()],
        fetch, local)
    board.open()
    return board


async def status_page(_request: Request) -> Response:
    return HTMLResponse(page_html(), headers={"cache-control": "no-store"})


async def status_json(request: Request) -> Response:
    board: StatusBoard = request.app.state.status_board
    expected = request.app.state.router.config.admin_key
    admin = bool(expected) and hmac.compare_digest(
        admin_key_given(request.headers.raw).encode(), expected.encode())
    return JSONResponse(await board.snapshot(admin=admin), headers={"cache-control": "no-store"})
