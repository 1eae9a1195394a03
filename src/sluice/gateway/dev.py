"""A development key for `sluice serve`: created once, printed, reused on later starts."""

from __future__ import annotations

import os
from pathlib import Path

from sluice import env
from sluice.gateway.store import KeySettings, Store, TenantSettings
from sluice.protocol.errors import NotFoundError

DEV_TENANT = "dev"


def ensure_dev_key(store: Store, path: Path | None = None) -> str | None:
    """The dev tenant's key, stored in `sluice.env.home()/dev-key` (mode 0600).

    Returns the saved key if it still authenticates; otherwise creates the `dev` tenant
    (interactive class, no limits) if missing, mints a key, saves and returns it. None if
    the `dev` tenant was deleted (`sluice tenants delete dev`): that took the dev key
    away, and minting another would undo it; the server starts without one.
    """
    path = path or env.home() / "dev-key"
    if path.exists():
        saved = path.read_text().strip()
        if saved and store.authenticate(saved) is not None:
            return saved
    try:
        if store.get_tenant(DEV_TENANT, deleted=True).deleted_at is not None:
            return None
    except NotFoundError:
        store.create_tenant(DEV_TENANT, TenantSettings(priority_class="interactive"))
    _, plaintext = store.create_key(DEV_TENANT, KeySettings(name="dev"))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(plaintext + "\n")
    return plaintext
