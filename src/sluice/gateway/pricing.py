"""Prices per model, per million input and output tokens, in US dollars.

Local models cost nothing by default (price 0), so budgets only bite where an operator
writes a price table: a JSON or YAML file mapping model name to
`{"input_per_million": X, "output_per_million": Y}`; the name `"*"` sets the default
for models not listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sluice.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class Price:
    input_per_million: float = 0.0
    output_per_million: float = 0.0

    def __post_init__(self) -> None:
        if self.input_per_million < 0 or self.output_per_million < 0:
            raise InvalidRequestError("prices must be >= 0", param="price")


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
    def from_mapping(cls, data: dict[str, Any]) -> PriceTable:
        prices = {name: Price(**spec) for name, spec in data.items()}
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
