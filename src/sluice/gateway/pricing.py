"""Prices per model, per million input and output tokens, in US dollars.

Local models cost nothing by default (price 0), so budgets only bite where an operator
writes a price table: a JSON or YAML file mapping model name to
`{"input_per_million": X, "output_per_million": Y}`; the name `"*"` sets the default
for models not listed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class Price:
    input_per_million: float = 0.0
    output_per_million: float = 0.0

    def __post_init__(self) -> None:
        """Finite numbers >= 0: a price of NaN made every cost NaN, which no budget
        comparison refuses, and `true` was a price of 1."""
        for name in ("input_per_million", "output_per_million"):
            value = getattr(self, name)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value < 0):
                raise InvalidRequestError(f"{name} must be a finite number >= 0, got "
                                          f"{value!r}", param=name)


@dataclass(frozen=True)
class PriceTable:
    prices: dict[str, Price] = field(default_factory=dict)
    default: Price = Price()

    def price(self, model: str | None) -> Price:
        return self.prices.get(model or "", self.default)

    def cost(self, model: str | None, prompt_tokens: int, completion_tokens: int) -> float:
        """Dollars for one request."""
        p = self.price(model)
        return (prompt_tokens * p.input_per_million
                + completion_tokens * p.output_per_million) / 1_000_000

    @classmethod
    def from_mapping(cls, data: Any) -> PriceTable:
        """`{model: {input_per_million, output_per_million}}`; anything else is an
        InvalidRequestError naming the model (or the field) at fault."""
        if not isinstance(data, dict):
            raise InvalidRequestError("a price table maps model names to prices, got "
                                      f"{type(data).__name__}", param="prices")
        prices = {str(name): _price(str(name), spec) for name, spec in data.items()}
        default = prices.pop("*", Price())
        return cls(prices, default)

    @classmethod
    def load(cls, path: Path | str) -> PriceTable:
        """Read a JSON (`.json`) or YAML file."""
        text = Path(path).read_text()
        if str(path).endswith(".json"):
            return cls.from_mapping(json.loads(text))
        import yaml

        return cls.from_mapping(yaml.safe_load(text) or {})


def _price(model: str, spec: Any) -> Price:
    fields = ("input_per_million", "output_per_million")
    if not isinstance(spec, dict) or not set(spec) <= set(fields):
        raise InvalidRequestError(f"the price of {model!r} must be a mapping with "
                                  f"{' and/or '.join(fields)}, got {spec!r}", param=model)
    try:
        return Price(**spec)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"the price of {model!r}: {exc.message}", param=model) from None
