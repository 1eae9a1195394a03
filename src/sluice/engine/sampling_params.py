"""Sampling parameters, shaped like vLLM's `SamplingParams`, validated on construction.

An out-of-range value raises `InvalidRequestError` (a `ValueError`) naming the
parameter, so the worker can turn it into a 400 without re-checking.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sluice.protocol.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # each output carries all text/tokens so far
    DELTA = "delta"  # each output carries only what is new since the last one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled one)
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or at least 1"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than 0"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.min_tokens >= 0, "min_tokens", "must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be non-empty strings"),
        ]
        for ok, param, why in checks:
            if not ok:
                value = getattr(self, param)
                raise InvalidRequestError(f"{param} {why}, got {value!r}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
