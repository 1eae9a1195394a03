"""The store's auth version, mirrored in the limiter's Redis: no database read per request.

A gateway that caches keys (`keycache.py`) must know, for every request, whether a key
was revoked or a tenant changed since it cached the answer. On SQLite that is a local
read of one counter row; on PostgreSQL it was a round trip per request (shared between
the requests that arrive together, on a worker thread), and at 1,000 req/s on a 2-core
host that read was most of what the gateway added (+7.3 ms p50 with it, +1.5 ms
without: docs/gateway.md, "The auth version in Redis").

With a Redis limiter the version is mirrored in Redis and read by the limiter's own
step (the script that admits the request `GET`s it: no extra round trip):

    change (revoke_key, update_tenant), any process:
        BEGIN; change; version += 1 (row lock); SELECT the registered mirrors; COMMIT
        then, for each mirror: SET key = max(key, version)     <- `tell`
    request:
        cached answer at version v  ->  admitted by the limiter, which also reads m
        v >= m  ->  the answer stands;  v < m  ->  give the slot back, read the store,
                                                   admit again with the fresh answer

A change is in force on every gateway once the call that made it returns: the mirror is
set before it returns, and the mirror is read atomically with the request's admission.
A gateway registers its Redis URL in the store (`SQLStore.register_auth_mirror`) in a
transaction that takes the same row lock as every change, so any change that commits
after the registration sees it, and every change before it is covered by the version
the registration seeds the mirror with. A change whose process cannot reach Redis
commits all the same and says so (503, `auth_mirror_unreachable`); gateways compare
the mirror with the store every `CHECK_EVERY_S` and raise it, so the change is in force
within that bound. A mirror key that is missing (Redis restarted) makes requests read
the store's version as before until the next check seeds it again. Gateways mark their
registration as in use every `TOUCH_EVERY_S`; one unreachable and unmarked for
`STALE_S` (Redis moved to another address) is dropped instead of failing every change,
and a gateway that still reads it registers it again at its next check. A gateway whose
Redis does not answer when it starts registers no mirror (a mistyped URL made every
change fail for `STALE_S`) and reads the store's version for its life.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # a gateway compares the mirror with the store at most this often
TOUCH_EVERY_S = 60.0  # ... and marks its registration as in use at most this often
STALE_S = 3600.0  # a registration no gateway marked for this long may be dropped

# SET KEYS[1] to ARGV[1] unless it already holds a version at least as new
_RAISE_LUA = """
local now = tonumber(redis.call('GET', KEYS[1]) or '-1')
if now < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
"""

def connect(url: str) -> Any:
    """A Redis client for the mirror at `url` (its owner, the store, closes it)."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)


def reachable(url: str) -> bool:
    """Whether Redis at `url` answers a PING now (a gateway registers a mirror only
    then: `KeyCache.use_mirror`)."""
    client = connect(url)
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def tell(client: Any, key: str, version: int) -> None:
    """Raise the mirror `key` to `version` (never lowers it). Raises redis-py's error if
    Redis cannot be reached."""
    client.eval(_RAISE_LUA, 1, key, version)
