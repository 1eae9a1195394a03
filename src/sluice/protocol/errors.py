"""One exception tree for all of sluice, mapped to OpenAI-style error JSON in one place.

    SluiceError                      500 internal_error
     ├── InvalidRequestError         400 invalid_request_error   (also a ValueError)
     │    ├── ContextLengthError     400 code=context_length_exceeded
     │    └── PayloadTooLargeError   413 code=request_too_large
     ├── AuthenticationError         401 authentication_error    code=invalid_api_key
     ├── PermissionDeniedError       403 permission_error
     ├── NotFoundError               404 not_found_error         code=model_not_found
     ├── ConflictError               409 conflict_error          (e.g. a swap already runs)
     ├── RateLimitError              429 rate_limit_error        code=rate_limit_exceeded
     │    └── InsufficientQuotaError 429 insufficient_quota      code=insufficient_quota
     ├── ServiceUnavailableError     503 service_unavailable     (Retry-After)
     └── ClientDisconnected          499 (nginx's code; nobody reads the answer)

Every HTTP edge (worker, router, gateway) installs `error_response` as its handler, so
a client sees the same `{"error": {"message", "type", "param", "code"}}` shape
everywhere. The engine raises `InvalidRequestError` for bad sampling parameters; since
it is also a `ValueError`, offline users can catch it as the standard exception.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


class SluiceError(Exception):
    """Base of every error sluice reports to a client."""

    status_code = 500
    error_type = "internal_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers: dict[str, str] = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequestError(SluiceError, ValueError):
    status_code = 400
    error_type = "invalid_request_error"


class MethodNotAllowedError(InvalidRequestError):
    status_code = 405
    default_code = "method_not_allowed"


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413
    default_code = "request_too_large"


class AuthenticationError(SluiceError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(SluiceError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(SluiceError):
    status_code = 404
    error_type = "not_found_error"
    default_code = "model_not_found"


class ConflictError(SluiceError):
    """The request conflicts with work in progress (an admin operation already running)."""

    status_code = 409
    error_type = "conflict_error"


class RateLimitError(SluiceError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        if retry_after is not None:
            self.headers.setdefault("Retry-After", str(max(1, int(retry_after + 0.999))))


class InsufficientQuotaError(RateLimitError):
    error_type = "insufficient_quota"
    default_code = "insufficient_quota"


class ServiceUnavailableError(SluiceError):
    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(max(1, int(retry_after + 0.999))))


class ClientDisconnected(SluiceError):
    """The client went away before the answer; the work for it was cancelled."""

    status_code = 499
    error_type = "client_disconnected"


def check_number(param: str, value: float | None, rule: str, ok: Callable[[float], bool]
                 ) -> None:
    """One numeric setting's check: a number (finite: no setting means anything at NaN or
    infinity) within `rule`; None passes (unset). The message names `param`, the field;
    the command lines name their flag in its place (`control/flags.py`)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise InvalidRequestError(f"{param} must be a finite number, got {value}", param=param)
    if not ok(value):
        raise InvalidRequestError(f"{param} {rule}, got {value:g}", param=param)
