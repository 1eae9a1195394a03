"""Sampling parameters, shaped like vLLM's `SamplingParams`, validated on construction.

An out-of-range value raises `InvalidRequestError` (a `ValueError`) naming the
parameter, so the worker can turn it into a 400 without re-checking.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from sluice.protocol.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"  # each output carries all text/tokens so far
    DELTA = "delta"  # each output carries only what is new since the last one
    FINAL_ONLY = "final_only"  # one output, when the request finishes


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint, as vLLM's `structured_outputs` names them.

    - `json`: a JSON schema (a JSON text; property order is generation order, so it is
      kept as given); `json_object`: any JSON object;
    - `regex`; `choice`: one of a list of strings; `grammar`: EBNF in xgrammar's dialect
      (GBNF-compatible), or Lark (llguidance's dialect; `guidance` backend, or `auto`);
      `structural_tag`: xgrammar's structural tag (JSON text), which the tool-call
      parsers use to force `<tool_call>{...}</tool_call>` blocks.

    `param` is the request field the constraint came from (`response_format`,
    `structured_outputs`, `tool_choice`): errors found later (a compile failure or
    timeout in the engine core) name it. It is not part of the compile cache key.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, dict | bool):  # vLLM's `json` takes a parsed schema too
            object.__setattr__(self, "json", _schema_text(self.json))
        for kind in ("json", "regex", "grammar", "structural_tag"):
            if getattr(self, kind) is not None and not isinstance(getattr(self, kind), str):
                raise InvalidRequestError(f"{kind} must be a string"
                                          f"{' or a dict' if kind == 'json' else ''}, got "
                                          f"{type(getattr(self, kind)).__name__}",
                                          param=self.param)
        if sum(1 for kind in STRUCTURED_KINDS if getattr(self, kind)) != 1:
            raise InvalidRequestError(
                f"exactly one of {', '.join(STRUCTURED_KINDS)} must be set", param=self.param)
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                      param=self.param)

    @classmethod
    def from_schema(cls, schema: Any, param: str) -> StructuredOutputsParams:
        """A JSON-schema constraint from a parsed schema (a dict, or `true`)."""
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object", param=param)
        return cls(json=_schema_text(schema), param=param)

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind))

    @property
    def key(self) -> tuple[str, Any]:
        """The compile cache key: what is compiled, not where it came from."""
        return self.kind, getattr(self, self.kind)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": list(self.choice) if self.choice else
                getattr(self, self.kind), "param": self.param}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StructuredOutputsParams:
        return cls(**{d["kind"]: d["value"], "param": d["param"]})


def _schema_text(schema: dict[str, Any] | bool) -> str:
    """A parsed JSON schema as the JSON text constraints carry (key order kept)."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


# Fields checked for their type before their range (a wrong type is a 400 naming the
# field, not a TypeError from a comparison); ints and floats come out as Python's own.
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "thinking_token_budget",
                  "truncate_prompt_tokens")
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
_BOOLS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


def is_integer(value: Any) -> bool:
    """An integer of any kind (Python's, numpy's), not a bool: what a count, a seed or a
    token id may be (int() would truncate 1.5 and read "7")."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


TRUNCATION_RULE = "must be -1 (the context length), a positive integer or None"


def truncation_ok(value: int | None) -> bool:
    """`truncate_prompt_tokens` is None, -1 or at least 1 (vLLM's rule: 0 would keep
    nothing)."""
    return value is None or is_integer(value) and (value == -1 or 1 <= value < 2**63)


def seed_in_range(seed: int | None) -> bool:
    """A seed the generator takes (None: unseeded): [-2**63, 2**64), as the worker's
    `seed` field bounds it."""
    return seed is None or -(2**63) <= seed < 2**64


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
    # vLLM's: the logprob of each prompt token after the first, given those before it, and
    # this many likeliest tokens at its position (0: only the prompt's own). Such a
    # request computes its whole prompt (no prefix-cache hits), as in vLLM
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's
    # logit_bias; -100 all but bans a token, 100 all but forces it). Logprobs stay the
    # model's own, as vLLM's default `raw_logprobs`
    logit_bias: dict[int, float] | None = None
    # P/D disaggregation (vLLM's `kv_transfer_params`, checked by the worker):
    # do_remote_decode: hold the prompt's KV for a decode engine; do_remote_prefill: pull
    # it from the prefill engine named here before computing (sluice.engine.kv_transfer)
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: a reasoning model thinks at most this many tokens; then its end tag is
    # written for it (the engine's `reasoning_parser` says where thinking starts and
    # ends; structured_output.Thinking). None (or -1): as long as it likes
    thinking_token_budget: int | None = None
    # OpenAI's predicted outputs (chat's `prediction`), tokenized: text the output is
    # expected to repeat much of (a file being edited). Speculative decoding drafts from
    # it (`spec_decode.PredictionProposer`); the output is the same as without it.
    prediction: list[int] | None = None
    # vLLM's: the prompt cut to its last this many tokens, after tokenizing (left
    # truncation; -1: to the context length; None: not cut). `InputProcessor.truncate`
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.top_k == 0:
            self.top_k = -1
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        self._validate()

    def _check_types(self) -> None:
        """Normalize each field's type (numpy numbers become Python's, `stop` a list);
        raise InvalidRequestError naming a field of the wrong type."""
        def bad(param: str, expected: str) -> InvalidRequestError:
            value = getattr(self, param)
            return InvalidRequestError(f"{param} must be {expected}, got {value!r}", param=param)

        for name in _INTS + _OPTIONAL_INTS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_INTS:
                continue
            if not is_integer(value):
                raise bad(name, "an integer" + (" or None" if name in _OPTIONAL_INTS else ""))
            setattr(self, name, int(value))
        for name in _FLOATS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise bad(name, "a number")
            setattr(self, name, float(value))
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list | tuple | type(None)):
            raise bad("stop", "a string or a list of strings")
        self.stop = list(self.stop or [])

        def token_ids(name: str) -> list[int]:
            value = getattr(self, name)
            if not isinstance(value, list | tuple | type(None)) or not all(
                    is_integer(t) for t in value or []):
                raise bad(name, "a list of token ids")
            return [int(t) for t in value or []]

        self.stop_token_ids = token_ids("stop_token_ids")
        self.prediction = token_ids("prediction") or None
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "a RequestOutputKind")
        if not isinstance(self.structured_outputs, StructuredOutputsParams | type(None)):
            raise bad("structured_outputs", "a StructuredOutputsParams (e.g. "
                      "StructuredOutputsParams(json=schema)) or None")
        if not isinstance(self.kv_transfer_params, dict | type(None)):
            raise bad("kv_transfer_params", "a dict or None")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or not all(
                    is_integer(t) and isinstance(v, numbers.Real) and not isinstance(v, bool)
                    for t, v in bias.items()):
                raise bad("logit_bias", "a dict of token ids to numbers")
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None

    def _validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (self.n >= 1, "n", "must be at least 1"),
            (0.0 <= self.temperature < math.inf, "temperature", "must be finite and non-negative"),
            (self.repetition_penalty < math.inf, "repetition_penalty", "must be finite"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or 1 <= self.top_k < 2**31, "top_k",
             "must be -1 or 0 (disabled), or in [1, 2**31)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than 0"),
            (seed_in_range(self.seed), "seed", "must be in [-2**63, 2**64)"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (0 <= self.min_tokens < 2**31, "min_tokens", "must be in [0, 2**31)"),
            (self.max_tokens is None or self.max_tokens < 2**31, "max_tokens",
             "must be less than 2**31"),
            (all(isinstance(t, int) and 0 <= t < 2**31 for t in self.stop_token_ids),
             "stop_token_ids", "must be token ids in [0, 2**31)"),
            (all(t >= 0 for t in self.prediction or ()), "prediction",
             "must be non-negative token ids"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "must not exceed max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             "must be in [0, 20]"),
            (self.thinking_token_budget is None or 0 <= self.thinking_token_budget < 2**31,
             "thinking_token_budget", "must be -1 (no limit) or in [0, 2**31)"),
            (truncation_ok(self.truncate_prompt_tokens), "truncate_prompt_tokens",
             TRUNCATION_RULE),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "must be non-empty strings"),
            (all(0 <= t < 2**31 and -100.0 <= v <= 100.0
                 for t, v in (self.logit_bias or {}).items()), "logit_bias",
             "must map token ids in [0, 2**31) to numbers in [-100, 100]"),
        ]
        for ok, param, why in checks:
            if not ok:
                value = getattr(self, param)
                raise InvalidRequestError(f"{param} {why}, got {value!r}", param=param)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
