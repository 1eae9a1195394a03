"""The default redaction hook for stored prompt and completion bodies.

Bodies are stored only for tenants that opt in, and then only after a `Redactor`
(any `Callable[[str], str]`) has run over them. The default masks e-mail addresses,
phone numbers and payment-card numbers (digit runs that pass the Luhn check, so order
numbers and timestamps survive). Operators with stricter needs inject their own.
"""

from __future__ import annotations

import re
from collections.abc import Callable

Redactor = Callable[[str], str]

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")
_CARD = re.compile(r"\b(?:\d[ -]?){12,18}\d\b")
_PHONE = re.compile(r"(?<![\w])(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?)?\d{3,4}[ .-]\d{3,4}(?:[ .-]\d{2,4})?(?![\w])")


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", match.group(0))
    return "[CARD]" if 13 <= len(digits) <= 19 and luhn_ok(digits) else match.group(0)


def default_redactor(text: str) -> str:
    """Mask e-mails, card numbers (Luhn-valid), then phone numbers."""
    text = _EMAIL.sub("[EMAIL]", text)
    text = _CARD.sub(_card, text)
    return _PHONE.sub("[PHONE]", text)
