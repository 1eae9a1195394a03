"""Routing policies, picked per pool by name from `POLICIES` (no if/elif on strings)."""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from sluice.protocol.errors import InvalidRequestError
from sluice.router.policies.base import Choice, RequestMeta, RoutingPolicy
from sluice.router.policies.cost import CostModel
from sluice.router.policies.prefix import KVAware, PrefixAffinity
from sluice.router.policies.simple import LeastLoad, RoundRobin, Session

POLICIES: Mapping[str, type[RoutingPolicy]] = MappingProxyType({
    cls.name: cls for cls in (RoundRobin, LeastLoad, Session, PrefixAffinity, KVAware, CostModel)
})


def make_policy(name: str, rng: random.Random | None = None,
                options: Mapping[str, Any] | None = None) -> RoutingPolicy:
    """A fresh policy instance (policies are never shared between pools)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidRequestError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}",
                                  param="policy")
    known = [p for p in inspect.signature(cls).parameters if p != "rng"]
    for key, value in (options or {}).items():  # a NaN weight makes every score NaN
        if key not in known:
            raise InvalidRequestError(f"policy {name!r} has no option {key!r}; its options: "
                                      f"{', '.join(known) or 'none'}",
                                      param=f"policy_options.{key}")
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRequestError(f"policy option {key} must be a finite number, got "
                                      f"{value}", param=f"policy_options.{key}")
    try:
        return cls(rng, **dict(options or {}))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc), param="policy_options") from exc


__all__ = ["POLICIES", "Choice", "RequestMeta", "RoutingPolicy", "make_policy"]
