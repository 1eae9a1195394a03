"""Structured output in the engine core: constraints compiled off the step loop, and one
token bitmask per constrained row, filled for the whole batch once per step.

    core.add(request)  ──► submit: compile (cached by constraint) on a thread
    core.step():           poll: compiled -> one matcher per sequence, request scheduled
                                 failed, or still compiling past the timeout -> 400
                           logits = forward(...)
                           mask(logits, rows)       one batched fill, applied in place
                                                    (a drafted sequence: one per verify row)
                           sample -> accept(seq, token) advances that sequence's matcher

The mask is applied before the sampler, so every sampler (greedy, top-k/p, seeded)
and the returned logprobs see only tokens the grammar allows (vLLM does the same).
Speculative decoding: a drafted sequence has one verify row per draft plus one; row i
gets the mask of the state after drafts 1..i (`GrammarBackend.mask` fills a row, accepts
a draft, and at the end rolls the matcher back), and `draftable` cuts a draft where
the grammar refuses it before it is verified.

A reasoning model's constrained output (`reasoning_parser`, the worker's
`--reasoning-parser`) thinks first, as in vLLM: while a sequence is `Thinking` its rows
are not masked and its matcher does not advance; the token that completes `</think>`
ends the thinking, and the grammar holds from the next one (`ThinkingMarkers`: where
the thinking starts is the parser's: in the prompt for deepseek_r1, at the model's own
`<think>` for qwen3, whose first token is then the grammar's or that tag; a prompt that
already closed the block, Qwen3's `enable_thinking: false`, starts with the grammar).

A matcher belongs to its `Sequence` and advances only on tokens the sequence keeps, so
preemption (recompute) and `n > 1` need nothing more: recomputing a preempted
sequence's KV re-reads tokens its matcher has already accepted.

A compile never runs on the step loop's thread: it runs on a thread of its own at the
lowest CPU priority, and only its own request waits for it. The step loop still slows
while an xgrammar compile runs (a hard schema is 0.2-0.4 s of CPU beside a forward that
wants every core; on one host the compile also held the GIL: docs/engine.md); an
llguidance compile is milliseconds with the GIL released. Constraints are cached, so
only a new one costs this. A request whose constraint is still compiling after
`structured_outputs_compile_timeout` fails with a 400 naming the request field it came
from (the compile finishes in the background and is cached; Python cannot stop a
running native compile).

Backends sit behind `GrammarBackend`, picked from `BACKENDS` by vLLM's names:
`xgrammar` (grammars compiled up front against the vocabulary, masks mostly cached)
and `guidance` (llguidance: an Earley parser and a lazily built lexer, so "compile" is
a few milliseconds with the GIL released and each mask is computed per step).
`auto` (`resolve_backend`) takes guidance where it can express and accepts the
constraint, xgrammar otherwise (structural tags llguidance cannot express, an EBNF only
xgrammar reads); docs/engine.md has the measurements behind that order.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sluice.engine.config import REASONING_PARSERS, StructuredOutputsConfig
from sluice.engine.sampling_params import StructuredOutputsParams
from sluice.protocol.errors import InvalidRequestError, SluiceError

if TYPE_CHECKING:
    import torch

    from sluice.engine.sequence import Request, Sequence
    from sluice.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

COMPILE_CACHE_SIZE = 256  # compiled constraints kept (LRU)
MASK_SAMPLES = 100_000  # recent (seconds, rows) of mask fills, for benchmarks


class Matcher(Protocol):
    """One sequence's position in its grammar. A token it refuses leaves it where it was;
    `rollback(n)` undoes the last `n` accepted tokens (never past a stop token: drafts
    stop before one, `draftable`)."""

    @property
    def stop_token_ids(self) -> list[int]: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def rollback(self, num_tokens: int) -> Any: ...


def draftable(matcher: Matcher, draft: list[int]) -> int:
    """How many of `draft`'s leading tokens the grammar takes, stopping at the first it
    refuses and before a stop token (it would end the sequence: nothing may follow it);
    `matcher` is left where it was (accepted, then rolled back)."""
    stops, n = set(matcher.stop_token_ids), 0
    for token in draft:
        if token in stops or not matcher.accept_token(token):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return n


# logits [B, V] float32, bitmask [B, W] int32, rows [R] int64, fill (the native kernel)
ApplyBitmask = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", float], None]


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer, makes matchers, masks logits; built as
    `Backend(tokenizer, vocab_size, apply_bitmask)` (`apply_bitmask`: the engine's native
    kernel for applying an xgrammar-layout bitmask, when it built).

    Contract: `check` needs no tokenizer and is cheap (the HTTP front end calls it to
    refuse bad input before admission); `compile` may run on any thread and raises
    `InvalidRequestError` naming `params.param` for a constraint it cannot compile;
    `fill` writes bitmask rows in xgrammar's layout (int32 words, bit `t % 32` of word
    `t // 32` set where token `t` is allowed) for matchers in their current state, and
    `apply` sets `logits` rows to minus infinity where a bit is clear, so one apply kernel
    serves every backend; `mask` (here) is the two, walking matchers through drafts.
    `supports` says whether the backend can express a kind of constraint at all (`auto`
    skips a backend that cannot; `check` refuses it with a 400 that says so).
    """

    @staticmethod
    def supports(params: StructuredOutputsParams) -> bool:
        return True

    @abc.abstractmethod
    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 apply_bitmask: ApplyBitmask | None = None) -> None: ...

    @staticmethod
    @abc.abstractmethod
    def check(params: StructuredOutputsParams) -> None: ...

    @abc.abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any: ...

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> Matcher: ...

    @abc.abstractmethod
    def bitmask(self, batch: int) -> torch.Tensor:
        """A reused [batch, W] int32 buffer."""

    @abc.abstractmethod
    def fill(self, bitmask: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
        """Bitmask row `rows[i]` := what `matchers[i]` allows next (one batched fill)."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Minus infinity in `logits` rows `rows` where their bitmask bit is clear."""

    def mask(self, logits: torch.Tensor, matchers: list[Matcher], rows: list[int],
             drafts: list[list[int]] | None = None) -> None:
        """Mask `logits` in place: row `rows[i]` for `matchers[i]`, and with `drafts`, the
        verify rows `rows[i] + j` (j = 0..len(drafts[i])) each in the state after the
        first j drafts. The walk is batched by depth (fill row j, accept draft j) and
        rolled back, so the matchers end where they began."""
        bitmask = self.bitmask(logits.shape[0])
        if drafts is None:
            self.fill(bitmask, matchers, rows)
            self.apply(logits, bitmask, rows)
            return
        index = [r + j for r, d in zip(rows, drafts, strict=True) for j in range(len(d) + 1)]
        bitmask[index] = -1  # a row the walk does not reach allows all (it is never used)
        walking, taken = list(range(len(matchers))), [0] * len(matchers)
        for depth in range(max(len(d) for d in drafts) + 1):
            self.fill(bitmask, [matchers[i] for i in walking], [rows[i] + depth for i in walking])
            walking = [i for i in walking if depth < len(drafts[i])
                       and matchers[i].accept_token(drafts[i][depth])]
            for i in walking:
                taken[i] += 1
        for matcher, n in zip(matchers, taken, strict=True):
            if n:
                matcher.rollback(n)
        self.apply(logits, bitmask, index)


# ------------------------------------------------------------------ reasoning models

THINK_START, THINK_END = "<think>", "</think>"
PROMPT_TAIL = 8  # tokens at the end of a prompt where a closed thinking block is seen


@dataclass(frozen=True)
class ThinkingMarkers:
    """The tags around a reasoning model's thinking, in its tokenizer's ids (a reasoning
    model's are one special token each; where they are several, they are matched as
    this tokenizer spells them alone)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    opened_in_prompt: bool  # deepseek_r1: the output begins inside the thinking

    @classmethod
    def of(cls, tokenizer: Any, parser: str) -> ThinkingMarkers | None:
        if not parser:
            return None
        return cls(tuple(tokenizer.encode(THINK_START, add_special_tokens=False)),
                   tuple(tokenizer.encode(THINK_END, add_special_tokens=False)),
                   REASONING_PARSERS[parser])

    def at_start(self, prompt: Tokens[int], budget: int | None = None) -> Thinking | None:
        """A new sequence's thinking state (a constrained one's, or one with a thinking
        `budget`): thinking (the prompt opened the block), deciding at its first token
        (the model opens it), or None: answering from the first token (the prompt
        closed the block, or the model's one-token opening tag is not one token here)."""
        tail = list(prompt[-PROMPT_TAIL:])
        ended, started = _last(tail, self.end), _last(tail, self.start)
        if ended is not None and (started is None or ended > started):
            return None
        if self.opened_in_prompt:
            return Thinking(self, "think", budget)
        return Thinking(self, "start", budget) if len(self.start) == 1 else None

    def closes(self, tokens: list[int], upto: int, draft: Tokens[int] = ()) -> int | None:
        """How many of `draft`'s tokens, after `tokens[:upto]`, it takes to complete the
        end tag (0: `tokens[:upto]` ends with it), or None."""
        n = len(self.end)
        for k in range(len(draft) + 1):
            if (draft[k - 1] if k else tokens[upto - 1] if upto else None) != self.end[-1]:
                continue
            if tuple([*tokens[max(0, upto - n + k):upto], *draft[:k]][-n:]) == self.end:
                return k
        return None


def _last(tokens: list[int], tag: tuple[int, ...]) -> int | None:
    """Where the last occurrence of `tag` in `tokens` ends, or None."""
    n = len(tag)
    for end in range(len(tokens), n - 1, -1):
        if tuple(tokens[end - n:end]) == tag:
            return end
    return None


@dataclass
class Thinking:
    """A reasoning model's sequence until its thinking ends, where its grammar waits or
    its `thinking_token_budget` counts (module docstring): `phase` "think" until the end
    tag, or "start" at the first token, which is the grammar's or the opening tag
    (allowed beside the grammar's tokens)."""

    markers: ThinkingMarkers
    phase: str
    budget: int | None = None  # thinking tokens allowed; then the end tag is forced
    spent: int = 0  # thinking tokens so far

    @property
    def room(self) -> int | None:
        """Thinking tokens left before the end tag is forced (None: no budget)."""
        if self.budget is None or self.phase != "think":
            return None
        return max(0, self.budget - self.spent)

    def forced(self, seq: Sequence) -> int | None:
        """The token `seq` must write next: once the budget is spent, the end tag's next
        token (after what of it the output already ends with); None: free."""
        if self.room != 0:
            return None
        end = self.markers.end
        for n in range(len(end) - 1, 0, -1):
            if seq.num_output_tokens >= n and tuple(seq.token_ids[-n:]) == end[:n]:
                return end[n]
        return end[0]

    def answer_from(self, seq: Sequence, draft: Tokens[int]) -> int | None:
        """Where the answer starts in `draft` (the grammar's part): the draft tokens after
        the end tag, or None if it is all thinking."""
        if self.phase == "start":
            return 0
        return self.markers.closes(seq.token_ids, len(seq.token_ids), draft)


# --------------------------------------------------------------------------- xgrammar


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[10:37:05] file.cc:94: "


def _reason(exc: Exception) -> str:
    """The first line of an xgrammar error, without its time and source-file prefix."""
    lines = str(exc).strip().splitlines()
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(exc).__name__


def _invalid(params: StructuredOutputsParams, exc: Exception) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {params.kind.replace('_', ' ')} constraint: "
                               f"{_reason(exc)}", param=params.param)


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of `schema` where each string with `minLength`/`maxLength` (and no pattern
    or format) says the same bound as a `pattern`.

    xgrammar 0.2.9 lowers length-bounded strings to a character class that admits raw
    control characters (U+0000-U+001F), i.e. invalid JSON (upstream issue
    mlc-ai/xgrammar#800, open); its `pattern` path is JSON-aware and does not. A
    bounded string then cannot hold escapes (`\\n`, `\\"`): valid JSON, a little stricter.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if bounded and out.get("type") == "string" and not {"pattern", "format", "enum",
                                                          "const"} & out.keys():
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^[^\\x00-\\x1f]{{{low},{'' if high is None else int(high)}}}$"
    return out


def _schema_text(params: StructuredOutputsParams) -> str:
    assert params.json is not None
    return json.dumps(bounded_strings_as_patterns(json.loads(params.json)))


def _compact_json_contents(fmt: Any, param: str) -> Any:
    """A structural tag's formats with each `json_schema` content (style `json`) replaced
    by its compact EBNF (`json_schema_ebnf`): xgrammar's own `json_schema` content allows
    any whitespace, and lacks the bounded-string fix."""
    if isinstance(fmt, list):
        return [_compact_json_contents(v, param) for v in fmt]
    if not isinstance(fmt, dict):
        return fmt
    if fmt.get("type") == "json_schema" and fmt.get("style", "json") == "json":
        return {"type": "grammar", "grammar": json_schema_ebnf(fmt.get("json_schema"), param)}
    return {k: _compact_json_contents(v, param) for k, v in fmt.items()}


def _structural_tag_text(params: StructuredOutputsParams) -> str:
    assert params.structural_tag is not None
    try:
        tag = json.loads(params.structural_tag)
    except ValueError as exc:
        raise InvalidRequestError(f"the structural tag is not valid JSON: {exc}",
                                  param=params.param) from None
    return json.dumps(_compact_json_contents(tag, params.param))


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """`root ::= "a" | "b"`: JSON string literals are valid EBNF literals in xgrammar."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarBackend(GrammarBackend):
    """xgrammar: grammars compiled against the tokenizer's vocabulary (token mask cache),
    one `GrammarMatcher` per sequence, `BatchGrammarMatcher` fills a step's masks.

    JSON is generated compact (no free whitespace between tokens): small models given
    "any whitespace" often emit newlines until `max_tokens`. vLLM's default is the
    opposite (`disable_any_whitespace` to opt out); this keeps outputs short and valid.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 apply_bitmask: ApplyBitmask | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._apply_bitmask = apply_bitmask
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads="auto")
        self._bitmask = xgr.allocate_token_bitmask(64, vocab_size)

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        XGrammarBackend.read(params)
        where = None
        if params.json is not None:
            where = unenforced_keyword(json.loads(params.json))
        elif params.structural_tag is not None:
            where = next((found for at, schema in tag_schemas(json.loads(params.structural_tag))
                          if (found := unenforced_keyword(schema, at)) is not None), None)
        if where is not None:
            raise InvalidRequestError(
                f"the xgrammar structured-output backend does not enforce the JSON "
                f"schema keyword at {where}; the output would not follow it",
                param=params.param)

    @staticmethod
    def read(params: StructuredOutputsParams) -> None:
        """Build the constraint's grammar, enforceable or not (a 400 naming its field
        when xgrammar cannot read it)."""
        import xgrammar as xgr

        builders: dict[str, Callable[[Any], Any]] = {
            "json": lambda v: xgr.Grammar.from_json_schema(_schema_text(params),
                                                           any_whitespace=False),
            "regex": xgr.Grammar.from_regex,
            "choice": lambda v: xgr.Grammar.from_ebnf(choice_ebnf(v)),
            "grammar": xgr.Grammar.from_ebnf,
            "structural_tag": lambda v: xgr.Grammar.from_structural_tag(
                _structural_tag_text(params)),
            "json_object": lambda v: None,
        }
        try:
            builders[params.kind](params.key[1])
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with a reason
            raise _invalid(params, exc) from None

    def compile(self, params: StructuredOutputsParams) -> Any:
        c, value = self.compiler, params.key[1]
        compilers: dict[str, Callable[[], Any]] = {
            "json": lambda: c.compile_json_schema(_schema_text(params), any_whitespace=False),
            "json_object": lambda: c.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=False),
            "regex": lambda: c.compile_regex(value),
            "choice": lambda: c.compile_grammar(choice_ebnf(value)),
            "grammar": lambda: c.compile_grammar(value),
            "structural_tag": lambda: c.compile_structural_tag(_structural_tag_text(params)),
        }
        try:
            return compilers[params.kind]()
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise _invalid(params, exc) from None

    def matcher(self, compiled: Any) -> Matcher:
        return self._xgr.GrammarMatcher(compiled)  # type: ignore[no-any-return]

    def bitmask(self, batch: int) -> torch.Tensor:
        if batch > self._bitmask.shape[0]:  # bitmask rows line up with logits rows
            self._bitmask = self._xgr.allocate_token_bitmask(batch, self.vocab_size)
        return self._bitmask[:batch]  # type: ignore[no-any-return]

    def fill(self, bitmask: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
        if matchers:
            self.batch.batch_fill_next_token_bitmask(matchers,  # type: ignore[arg-type]
                                                     bitmask, indices=rows)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import torch

        if self._apply_bitmask is not None and logits.dtype == torch.float32 \
                and logits.device.type == "cpu" and logits.is_contiguous():
            self._apply_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.long),
                                float("-inf"))
        else:
            self._xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def json_schema_ebnf(schema: Any, param: str) -> str:
    """A JSON schema as a compact-JSON EBNF grammar (for grammars built around JSON, such
    as a tool call's arguments inside its tags); a 400 naming `param` if it is invalid."""
    import xgrammar as xgr

    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(bounded_strings_as_patterns(schema)),
                                                any_whitespace=False))
    except Exception as exc:
        raise InvalidRequestError(f"invalid JSON schema: {_reason(exc)}", param=param) from None


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> Any:
    """xgrammar's view of a `tokenizers` vocabulary: token strings by id (padded to the
    model's vocabulary), the encoding kind read from the tokenizer's own JSON, EOS ids."""
    import xgrammar as xgr

    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * max(vocab_size, max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=meta["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids),
                             add_prefix_space=meta["add_prefix_space"])


# --------------------------------------------------------------------------- llguidance

# xgrammar's compact JSON (`any_whitespace=False`): no free whitespace, ", " and ": "
GUIDANCE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "contains", "propertyNames", "if",
                "then", "else")


# Keywords xgrammar 0.2.9 reads and enforces nothing of (its grammar is the same without
# them; `uniqueItems: true` and `not` accept violating text), as vLLM lists them for it.
XGRAMMAR_UNENFORCED = frozenset({"not", "if", "then", "else", "contains", "minContains",
                                 "maxContains", "dependentRequired", "dependentSchemas",
                                 "unevaluatedItems", "unevaluatedProperties"})


def unenforced_keyword(schema: Any, path: str = "#") -> str | None:
    """The JSON pointer of the first keyword in `schema` (walked as a schema: property
    names and `default`/`const` values are not keywords) that xgrammar does not enforce."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in XGRAMMAR_UNENFORCED or (key == "uniqueItems" and value is True):
            return f"{path}/{key}"
    subschemas = [(f"{path}/{key}/{name}", sub) for key in _SCHEMA_MAPS
                  if isinstance(schema.get(key), dict) for name, sub in schema[key].items()]
    subschemas += [(f"{path}/{key}/{i}", sub) for key in _SCHEMA_LISTS
                   if isinstance(schema.get(key), list) for i, sub in enumerate(schema[key])]
    subschemas += [(f"{path}/{key}", schema[key]) for key in _SCHEMA_ONES if key in schema]
    return next((found for sub_path, sub in subschemas
                 if (found := unenforced_keyword(sub, sub_path)) is not None), None)


def tag_schemas(tag: Any, path: str = "") -> list[tuple[str, Any]]:
    """The JSON schemas inside a structural tag, each with where it is (`format.content.
    json_schema#`): every `json_schema` format's, and each of the legacy form's
    `structures[i].schema` (vLLM's tool-call tags)."""
    if isinstance(tag, list):
        return [found for i, v in enumerate(tag) for found in tag_schemas(v, f"{path}.{i}")]
    if not isinstance(tag, dict):
        return []
    here = [(f"{path}.{key}#".lstrip("."), tag[key]) for key in ("json_schema", "schema")
            if isinstance(tag.get(key), dict) and (key == "schema" or tag.get("type") ==
                                                   "json_schema")]
    return here + [found for key, value in tag.items() if key not in ("json_schema", "schema")
                   for found in tag_schemas(value, f"{path}.{key}")]


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which an object schema that lists `properties` (or
    `patternProperties`) and says nothing of `additionalProperties` forbids others, as
    xgrammar's `strict_mode` (its default) does: llguidance follows JSON Schema (others
    allowed), which lets a model pad an object with invented keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONES:
        if key in out:
            out[key] = closed_objects(out[key])
    if ("properties" in out or "patternProperties" in out) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class _Unsupported(Exception):
    """A structural tag format that has no Lark translation here."""


_LARK_REPEATS = {"optional": "?", "plus": "+", "star": "*"}


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a Lark string literal


def _lark_format(fmt: Any) -> str:
    """One xgrammar structural-tag format as a Lark expression (llguidance's dialect)."""
    if not isinstance(fmt, dict):
        raise _Unsupported(f"format {fmt!r} is not an object")
    kind = fmt.get("type")
    if kind == "const_string":
        return _lark_string(fmt["value"])
    if kind == "json_schema" and fmt.get("style", "json") == "json":
        schema = {} if fmt["json_schema"] is True else fmt["json_schema"]
        if not isinstance(schema, dict):
            raise _Unsupported("a json_schema that is not an object or true")
        return "%json " + json.dumps({**closed_objects(schema), "x-guidance": GUIDANCE_JSON},
                                     ensure_ascii=False)
    if kind == "regex":
        import llguidance as llg

        return f"/{llg.regex_to_lark(fmt['pattern'])}/"
    if kind in ("sequence", "or"):
        sep = " " if kind == "sequence" else " | "
        return "(" + sep.join(_lark_format(e) for e in fmt["elements"]) + ")"
    if kind in _LARK_REPEATS:
        return f"({_lark_format(fmt['content'])}){_LARK_REPEATS[kind]}"
    if kind == "repeat":
        return f"({_lark_format(fmt['content'])}){{{int(fmt['min'])},{int(fmt['max'])}}}"
    if kind == "tag":
        ends = fmt["end"] if isinstance(fmt["end"], list) else [fmt["end"]]
        if not isinstance(fmt["begin"], str) or not all(isinstance(e, str) for e in ends):
            raise _Unsupported("token begin/end")
        end = "(" + " | ".join(_lark_string(e) for e in ends) + ")"
        return f"{_lark_string(fmt['begin'])} {_lark_format(fmt['content'])} {end}"
    if kind == "tags_with_separator":
        tag = "(" + " | ".join(_lark_format(t) for t in fmt["tags"]) + ")"
        body = tag if fmt.get("stop_after_first") else \
            f"{tag} ({_lark_string(fmt['separator'])} {tag})*"
        return f"({body})" if fmt.get("at_least_one") else f"({body})?"
    raise _Unsupported(f"format type {kind!r}")


def structural_tag_lark(text: str) -> str:
    """An xgrammar structural tag (`{"type": "structural_tag", "format": ...}`) as a Lark
    grammar. Translated: const_string, json_schema (style json, compact like xgrammar's),
    regex, sequence, or, optional, plus, star, repeat, tag (string begin/end),
    tags_with_separator. Not: grammar, any_text, triggered tags, dispatch, tokens, the
    legacy `structures`/`triggers` form (`_Unsupported`; `auto` gives those to xgrammar)."""
    tag = json.loads(text)
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or "format" not in tag:
        raise _Unsupported("only the {\"type\": \"structural_tag\", \"format\": ...} form")
    try:
        return "start: " + _lark_format(tag["format"]) + "\n"
    except (KeyError, TypeError) as exc:
        raise _Unsupported(f"malformed format ({exc!r})") from None


def _guidance_grammar(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (serialized); raises ValueError or
    `_Unsupported` for what cannot be one (no tokenizer needed)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    value = params.key[1]
    if params.kind in ("json", "json_object"):
        schema = closed_objects(json.loads(params.json)) if params.json else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(schema, defaults=GUIDANCE_JSON)  # type: ignore[arg-type]
    if params.kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if params.kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(map(_lark_string, value)))
    if params.kind == "grammar":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(value))
        except Exception as exc:  # GbnfToLarkError and friends
            raise ValueError(f"not GBNF/EBNF or Lark: {exc}") from None
    return LLMatcher.grammar_from_lark(structural_tag_lark(value))


def _guidance_invalid(params: StructuredOutputsParams, error: str) -> InvalidRequestError:
    """A 400 with llguidance's reason: its first line, and a regex error's `error:` line
    (the lines between draw the regex and a caret)."""
    lines = [line.strip() for line in error.strip().splitlines()] or ["invalid"]
    reason = " ".join([lines[0], *[line for line in lines[1:] if line.startswith("error:")][:1]])
    return InvalidRequestError(f"invalid {params.kind.replace('_', ' ')} constraint: {reason}",
                               param=params.param)


class GuidanceMatcher:
    """An `LLMatcher` behind sluice's `Matcher` protocol: terminated once it takes an EOS
    token (as xgrammar's), or once it is in error. A refused token leaves it where it was
    (`try_consume_tokens`; `consume_token` would put it in error), as xgrammar's does. In
    error (its lexer's limits, say, hit while consuming or masking) it refuses every
    token, so the request fails rather than ending on the EOS its mask then allows."""

    __slots__ = ("inner", "_eos", "_done")

    def __init__(self, inner: Any, eos: frozenset[int]) -> None:
        self.inner, self._eos, self._done = inner, eos, False

    @property
    def stop_token_ids(self) -> list[int]:
        return sorted(self._eos)

    def accept_token(self, token_id: int) -> bool:
        if self.inner.is_error():  # a limit hit while masking (the mask then allows EOS)
            return False
        if token_id in self._eos:
            self._done = True
            return bool(self.inner.consume_token(token_id))
        return bool(self.inner.try_consume_tokens([token_id]) == 1)

    def is_terminated(self) -> bool:
        return self._done or bool(self.inner.is_error())

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` (llguidance does not count a consumed EOS, so this
        is never called past one: drafts stop before a stop token)."""
        assert not self._done, "rollback past a stop token"
        return bool(self.inner.rollback(num_tokens))


class LLGuidanceBackend(GrammarBackend):
    """llguidance (vLLM's `guidance`): a constraint becomes a template `LLMatcher` (grammar
    checked, lexer built lazily: milliseconds, GIL released), each sequence gets a copy,
    and `LLExecutor` fills a step's masks with the GIL released.

    Grammars (`grammar`) are Lark (llguidance's dialect) or GBNF, which includes the EBNF
    of xgrammar's tests (`root ::= ...`); GBNF is converted to Lark first. JSON is compact
    with xgrammar's separators, and objects are closed as in xgrammar's strict mode
    (`closed_objects`), so both backends admit the same texts for a schema.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 apply_bitmask: ApplyBitmask | None = None) -> None:
        import llguidance as llg
        import torch

        self._llg = llg
        self._apply_bitmask = apply_bitmask
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.tokenizer = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                         eos_token=sorted(self.eos))
        self.executor = llg.LLExecutor()
        self._bitmask = torch.full((64, (vocab_size + 31) // 32), -1, dtype=torch.int32)

    @staticmethod
    def supports(params: StructuredOutputsParams) -> bool:
        if params.kind != "structural_tag":
            return True
        try:
            structural_tag_lark(params.key[1])
        except (_Unsupported, ValueError):
            return False
        return True

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        from llguidance import LLMatcher

        try:
            grammar = _guidance_grammar(params)
        except _Unsupported as exc:
            raise InvalidRequestError(
                f"the guidance structured-output backend cannot express this structural tag "
                f"({exc}); use structured_outputs_backend xgrammar or auto",
                param=params.param) from None
        except ValueError as exc:
            raise _guidance_invalid(params, str(exc)) from None
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise _guidance_invalid(params, error)

    def compile(self, params: StructuredOutputsParams) -> Any:
        try:
            grammar = _guidance_grammar(params)
        except (_Unsupported, ValueError) as exc:
            raise _guidance_invalid(params, str(exc)) from None
        template = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _guidance_invalid(params, template.get_error())
        return template

    def matcher(self, compiled: Any) -> Matcher:
        return GuidanceMatcher(compiled.deep_copy(), self.eos)

    def bitmask(self, batch: int) -> torch.Tensor:
        import torch

        if batch > self._bitmask.shape[0]:  # bitmask rows line up with logits rows
            self._bitmask = torch.full((batch, self._bitmask.shape[1]), -1, dtype=torch.int32)
        return self._bitmask[:batch]

    def fill(self, bitmask: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
        pairs = [(m.inner, row) for m, row in zip(matchers, rows, strict=True)]  # type: ignore[attr-defined]
        if pairs:
            self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(),
                                                  bitmask.shape[1] * 4, bitmask.shape[0])

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        import torch

        index = torch.tensor(rows, dtype=torch.long)
        if self._apply_bitmask is not None and logits.dtype == torch.float32 \
                and logits.device.type == "cpu" and logits.is_contiguous():
            self._apply_bitmask(logits, bitmask, index, float("-inf"))
        else:
            apply_bitmask_torch(logits, bitmask, index)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """The apply kernel in plain torch (any dtype or device): minus infinity in `logits`
    rows `rows` wherever the bitmask bit is clear."""
    import torch

    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(len(rows), -1)[:, :logits.shape[1]].bool().to(logits.device)
    index = rows.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


# --------------------------------------------------------------------------- the registry

BACKENDS: dict[str, type[GrammarBackend]] = {"xgrammar": XGrammarBackend,
                                             "guidance": LLGuidanceBackend}
AUTO_ORDER = ("guidance", "xgrammar")  # why guidance first: docs/engine.md


def resolve_backend(name: str, params: StructuredOutputsParams) -> str:
    """The backend that compiles `params` when `structured_outputs_backend` is `name`: the
    named one, or for `auto` the first of `AUTO_ORDER` that supports and accepts it (a
    constraint no backend accepts raises the first one's 400)."""
    if name != "auto":
        return name
    first: InvalidRequestError | None = None
    for candidate in AUTO_ORDER:
        backend = BACKENDS[candidate]
        if not backend.supports(params):
            continue
        try:
            backend.check(params)
        except InvalidRequestError as exc:
            first = first or exc
            continue
        return candidate
    assert first is not None  # xgrammar supports every kind
    raise first


def check_constraint(params: StructuredOutputsParams, backend: str = "auto") -> None:
    """The front end's quick check of a constraint for the configured backend (400
    naming its field)."""
    if params.json is not None:
        try:
            json.loads(params.json)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                      param=params.param) from None
    if backend == "auto":
        resolve_backend(backend, params)
    else:
        BACKENDS[backend].check(params)


def check_json_schema(params: StructuredOutputsParams) -> None:
    """A JSON schema that a backend reads, whether or not one could enforce all of it: a
    tool's `parameters` when no call is forced (nothing compiles them)."""
    try:
        check_constraint(params, "auto")
    except InvalidRequestError:
        XGrammarBackend.read(params)  # raises when xgrammar cannot read it either


# --------------------------------------------------------------------------- the manager


def _lowest_cpu_priority() -> None:
    """Run this (compile) thread at nice 19, so the forward pass's threads win the cores
    (Linux sets nice per thread; elsewhere this does nothing). It cannot win back the GIL
    from a compile that holds it (xgrammar's did on one host; llguidance releases it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


class CompileThread:
    """One daemon thread that runs compiles in the order submitted, at nice 19.

    Not a `ThreadPoolExecutor`: the interpreter joins those at exit, and a compile cannot
    be stopped once running, so a process whose last request had a slow constraint (one
    past its compile timeout, already failed) stayed alive until the compile ended
    (minutes for a pathological schema). Nothing waits for a compile's result once the
    core is gone, so a daemon thread may die with the process."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="sluice-grammar", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((future, fn))
        return future

    def _run(self) -> None:
        _lowest_cpu_priority()
        while (item := self._queue.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever reads the future
                future.set_exception(exc)

    def shutdown(self) -> None:
        """Cancel the compiles not started; the running one ends by itself."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._queue.put(None)


@dataclass(frozen=True)
class _Compiled:
    backend: GrammarBackend
    grammar: Any


@dataclass
class _Pending:
    request: Request
    future: Future[_Compiled]
    deadline: float


class StructuredOutputManager:
    """The core's structured-output state: compile cache, requests waiting for their
    grammar, and the per-step mask. Used from the core's thread only (compiles run on
    this object's own executor)."""

    def __init__(self, config: StructuredOutputsConfig,
                 make_backend: Callable[[str], GrammarBackend],
                 thinking: ThinkingMarkers | None = None) -> None:
        self.thinking = thinking  # a reasoning model's tags: its grammar starts after them
        self.timeout = config.structured_outputs_compile_timeout
        self.backend_name = config.structured_outputs_backend
        self._make_backend = make_backend
        self._backends: dict[str, GrammarBackend] = {}  # by name, loaded on first use
        self._owners: dict[type, GrammarBackend] = {}  # matcher type -> its backend
        self._backend_lock = threading.Lock()
        self._loading = False  # a backend is loading (the compile thread sets it)
        self._executor: CompileThread | None = None
        self._compiled: OrderedDict[tuple[str, Any], Future[_Compiled]] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self.mask_samples: deque[tuple[float, int]] = deque(maxlen=MASK_SAMPLES)

    # -- admission ----------------------------------------------------------------
    def submit(self, request: Request, now: float) -> None:
        """Start (or reuse) the compile of the request's constraint; it waits here."""
        params = request.params.structured_outputs
        assert params is not None
        future = self._compiled.get(params.key)
        if future is None or (future.done() and future.exception() is not None
                              and not isinstance(future.exception(), InvalidRequestError)):
            future = self._compile_async(params)
        self._compiled.move_to_end(params.key)
        while len(self._compiled) > COMPILE_CACHE_SIZE:
            self._compiled.popitem(last=False)
        self._pending[request.request_id] = _Pending(request, future, now + self.timeout)

    def _compile_async(self, params: StructuredOutputsParams) -> Future[_Compiled]:
        if self._executor is None:
            self._executor = CompileThread()
        future = self._compiled[params.key] = self._executor.submit(
            lambda: self._compile(params))
        return future

    def _compile(self, params: StructuredOutputsParams) -> _Compiled:
        backend = self._backend(resolve_backend(self.backend_name, params))
        return _Compiled(backend, backend.compile(params))

    def _backend(self, name: str) -> GrammarBackend:
        with self._backend_lock:
            if name not in self._backends:
                self._loading = True
                try:
                    self._backends[name] = self._make_backend(name)
                finally:
                    self._loading = False
            return self._backends[name]

    def poll(self, now: float) -> tuple[list[Request], list[tuple[str, SluiceError]]]:
        """Requests whose grammar is ready (matchers attached to every sequence), and
        requests that failed: a compile error, or the timeout."""
        ready: list[Request] = []
        failed: list[tuple[str, SluiceError]] = []
        for rid, p in list(self._pending.items()):
            if self._loading:  # loading a backend (seconds, once) is not compiling
                p.deadline = now + self.timeout
            if p.future.done():
                del self._pending[rid]
                error = p.future.exception()
                if error is None:
                    error = self._attach(p.request, p.future.result())
                if error is None:
                    ready.append(p.request)
                else:
                    failed.append((rid, self._as_error(p, error)))
            elif now >= p.deadline:
                del self._pending[rid]
                params = p.request.params.structured_outputs
                assert params is not None
                failed.append((rid, InvalidRequestError(
                    f"compiling the {params.kind.replace('_', ' ')} constraint took longer "
                    f"than {self.timeout:g} s (structured_outputs_compile_timeout)",
                    param=params.param)))
        return ready, failed

    @staticmethod
    def _as_error(p: _Pending, error: BaseException) -> SluiceError:
        if isinstance(error, SluiceError):
            return error
        params = p.request.params.structured_outputs
        return SluiceError(f"structured output backend failed: {error}",
                           param=params.param if params else None)

    def _attach(self, request: Request, compiled: _Compiled) -> SluiceError | None:
        """A matcher per sequence, advanced past the tokens a resumed (migrated) request
        already generated, so the grammar continues where the other worker left it."""
        for seq in request.seqs:
            seq.grammar = compiled.backend.matcher(compiled.grammar)
            self._owners[type(seq.grammar)] = compiled.backend
            refused = self.replay(seq)
            if refused is not None:
                params = request.params.structured_outputs
                return InvalidRequestError(
                    f"resumed token {refused} does not match the constraint",
                    param=params.param if params else None)
        return None

    def replay(self, seq: Sequence) -> int | None:
        """A new sequence's thinking state (a reasoning model's: a constrained one's, or
        an unconstrained one's with a `thinking_token_budget`) and its matcher, moved
        past the tokens a resumed (migrated) request already generated; the first of
        them its grammar refuses, or None."""
        if self.thinking is not None:
            seq.thinking = self.thinking.at_start(seq.token_ids[:seq.num_prompt_tokens],
                                                  seq.params.thinking_token_budget)
        for at in range(seq.num_prompt_tokens, seq.num_tokens):
            token = seq.token_ids[at]
            if self._answer(seq, token, at + 1) and seq.grammar is not None \
                    and not seq.grammar.accept_token(token):
                return token
        return None

    def wait(self, timeout: float) -> None:
        """Block until a pending compile finishes or `timeout` passes (an idle core
        waiting only for grammars must not spin)."""
        if self._pending:
            wait([p.future for p in self._pending.values()], timeout,
                 return_when=FIRST_COMPLETED)

    def cancel(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def is_pending(self, request_id: str) -> bool:
        return request_id in self._pending

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    # -- the step -----------------------------------------------------------------
    def mask(self, logits: torch.Tensor, seqs: list[Sequence],
             drafts: dict[Sequence, list[int]] | None = None) -> None:
        """Mask the rows of constrained sequences (one batched fill per backend); no-op
        otherwise. A sequence has one row, or with a draft (speculative decoding) its
        len(draft) + 1 verify rows, each masked in the grammar state after the drafts
        before it (`GrammarBackend.mask`); matchers end where they began."""
        drafts = drafts or {}
        by_backend: dict[GrammarBackend, tuple[list[Sequence], list[int], list[list[int]]]] = {}
        opening: list[tuple[int, int]] = []  # (row, token): a first token that may open thinking
        row = 0
        for seq in seqs:  # one batched fill per backend (one, unless auto mixes them)
            walk = drafts.get(seq, [])
            answer = 0 if seq.thinking is None else seq.thinking.answer_from(seq, walk)
            if seq.grammar is not None and answer is not None:  # rows of the answer
                own, rows, walks = by_backend.setdefault(self._owners[type(seq.grammar)],
                                                         ([], [], []))
                own.append(seq)
                rows.append(row + answer)
                walks.append(walk[answer:])
                if seq.thinking is not None and seq.thinking.phase == "start":
                    opening.append((row, seq.thinking.markers.start[0]))
            row += len(walk) + 1
        if not by_backend:
            return
        start = time.perf_counter()
        kept = [(r, t, float(logits[r, t])) for r, t in opening]
        for backend, (own, rows, walks) in by_backend.items():
            backend.mask(logits, [s.grammar for s in own], rows, walks if drafts else None)
        if kept:
            import torch

            with torch.inference_mode():  # (the forward's logits are inference tensors)
                for r, t, value in kept:
                    logits[r, t] = value
        self.mask_samples.append((time.perf_counter() - start,
                                  sum(len(rows) for _, rows, _ in by_backend.values())))

    def force(self, logits: torch.Tensor, seqs: list[Sequence],
              drafts: dict[Sequence, list[int]] | None = None) -> None:
        """A thinking sequence whose `thinking_token_budget` is spent writes its end tag:
        its row allows that token alone (its draft was cut short of the budget:
        spec_decode.grammatical, so only its first row can be due)."""
        if self.thinking is None:  # (no reasoning parser: nothing is ever due)
            return
        drafts = drafts or {}
        due: list[tuple[int, int]] = []
        row = 0
        for seq in seqs:
            if seq.thinking is not None and (token := seq.thinking.forced(seq)) is not None:
                due.append((row, token))
            row += len(drafts.get(seq, ())) + 1
        if not due:
            return
        import torch

        with torch.inference_mode():  # (the forward's logits are inference tensors)
            for r, token in due:
                value = float(logits[r, token])
                logits[r].fill_(float("-inf"))
                logits[r, token] = value if value > float("-inf") else 0.0

    def accept(self, seq: Sequence, token: int) -> InvalidRequestError | None:
        """Advance the sequence's matcher on the token just appended (unless it is still
        thinking, `_answer`); the error to fail the request with when the grammar refuses
        the token (the mask allowed it: a backend's own limit, such as llguidance's lexer
        on `a{1000000}`, or a vocabulary that outgrew the tokenizer's)."""
        if seq.thinking is not None and not self._answer(seq, token, seq.num_tokens):
            return None
        return self.take(seq, token) if seq.grammar is not None else None

    @staticmethod
    def _answer(seq: Sequence, token: int, upto: int) -> bool:
        """Whether `token` (ending `seq.token_ids[:upto]`) is the answer's, for the
        grammar; a thinking sequence's state moves on: a first token other than the
        opening tag starts the answer, the end tag's last token ends the thinking."""
        thinking = seq.thinking
        if thinking is None:
            return True
        if thinking.phase == "start":
            opened = token == thinking.markers.start[0]
            thinking.phase = "think"
            if not opened:
                seq.thinking = None
            return not opened
        if upto - seq.num_prompt_tokens >= len(thinking.markers.end) and \
                thinking.markers.closes(seq.token_ids, upto) == 0:
            seq.thinking = None  # the answer, and the grammar, start with the next token
        else:
            thinking.spent += 1
        return False

    @staticmethod
    def take(seq: Sequence, token: int) -> InvalidRequestError | None:
        """Advance the sequence's matcher on an answer token (`accept`)."""
        if seq.grammar.accept_token(token):
            return None
        log.error("grammar refused token %d of request %s", token, seq.request_id)
        reason = f"token {token} was refused"
        if isinstance(seq.grammar, GuidanceMatcher) and seq.grammar.inner.is_error():
            reason = seq.grammar.inner.get_error().splitlines()[0]
        constraint = seq.params.structured_outputs
        return InvalidRequestError(
            f"the structured-output backend could not follow this constraint after "
            f"{seq.num_output_tokens - 1} tokens ({reason}); simplify it or try "
            f"structured_outputs_backend xgrammar",
            param=constraint.param if constraint is not None else None)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
