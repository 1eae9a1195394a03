"""Unique ids for the request path without a system call each.

`uuid.uuid4()` and `secrets.token_hex` read the kernel's random source on every call,
a system call that cost 5-7 us a time on this project's VMs, and a request through the
gateway drew three (its request id, its limiter lease, its ledger record). Here each
process draws 64 random bits once (again in a forked child) and a random start for a
64-bit counter; an id is the prefix and the counter: 32 hex digits, `uuid4().hex`'s
length. Two ids of one process never repeat; two processes repeat one only if they drew
the same prefix (a chance of about n² / 2^65 for n processes) and overlapping counter
ranges. They are unique, not secret: nothing here may serve as a credential.
"""

from __future__ import annotations

import itertools
import os

_prefix = ""
_counter = itertools.count()


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count(int.from_bytes(os.urandom(8), "big") >> 2)  # 2^62 left


_reseed()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def unique_hex() -> str:
    """32 hex digits, unique across this process's calls and (with the chance above)
    across processes; thread-safe (`next` on a counter holds the GIL)."""
    return f"{_prefix}{next(_counter):016x}"
