"""API keys: generated from `secrets`, shown once, stored only as a SHA-256 digest.

A key is `sk-sluice-` followed by 32 random bytes in URL-safe base64 (43 characters,
256 bits). Because keys carry that much entropy, an unsalted SHA-256 is enough to make
the stored digest useless to a thief (no dictionary to try), and lookups are a plain
indexed equality on the digest, so no constant-time comparison is needed: the secret
never meets a comparison, only its hash does.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

KEY_PREFIX = "sk-sluice-"
KEY_BYTES = 32


@dataclass(frozen=True)
class NewKey:
    """A freshly minted key: `plaintext` is shown to the caller once and never stored."""

    plaintext: str
    digest: str
    display: str


def hash_key(plaintext: str) -> str:
    """The stored form of a key: hex SHA-256 of its UTF-8 bytes."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def display_form(plaintext: str) -> str:
    """What listings show: the prefix and the last four characters, e.g. `sk-sluice-...x7Qa`."""
    return f"{KEY_PREFIX}...{plaintext[-4:]}"


def generate_key() -> NewKey:
    """Mint a key with 256 bits of `secrets` entropy."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
    return NewKey(plaintext=plaintext, digest=hash_key(plaintext), display=display_form(plaintext))


def new_id(kind: str) -> str:
    """A short public identifier (`tn_...`, `key_...`): not a secret, safe to log."""
    return f"{kind}_{secrets.token_hex(8)}"
