"""Structured output in the engine core: constraints compiled off the step loop, and one
token bitmask per constrained row, filled for the whole batch once per step.

    core.add(request)  ──► submit: compile (cached by constraint) on a thread
    core.step():           poll: compiled -> one matcher per sequence, request scheduled
                                 failed, or still compiling past the timeout -> 400
                           logits = forward(...)
                           mask(logits, rows)       one batched fill, applied in place
                           sample -> accept(seq, token) advances that sequence's matcher

The mask is applied before the sampler, so every sampler (greedy, top-k/p, seeded)
and the returned logprobs see only tokens the grammar allows (vLLM does the same).
A matcher belongs to its `Sequence` and advances only on tokens the sequence keeps, so
preemption (recompute) and `n > 1` need nothing more: recomputing a preempted
sequence's KV re-reads tokens its matcher has already accepted.

A compile never runs on the step loop's thread: it runs on a thread of its own at the
lowest CPU priority, and only its own request waits for it. The step loop still slows
while a compile runs, because xgrammar holds the GIL while compiling (measured in
docs/engine.md); constraints are cached, so only a new one costs this. A request whose
constraint is still compiling after `structured_outputs_compile_timeout` fails with a
400 naming the request field it came from (the compile finishes in the background and
is cached; Python cannot stop a running C++ compile).

Backends sit behind `GrammarBackend` (xgrammar today; llguidance or outlines-core would
be a second implementation) and are picked from `BACKENDS` by name.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from sluice.engine.config import StructuredOutputsConfig
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
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


# logits [B, V] float32, bitmask [B, W] int32, rows [R] int64, fill (the native kernel)
ApplyBitmask = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", float], None]


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer, makes matchers, masks logits; built as
    `Backend(tokenizer, vocab_size, apply_bitmask)` (`apply_bitmask`: the engine's native
    kernel for applying an xgrammar-layout bitmask, when it built).

    Contract: `check` needs no tokenizer and is cheap (the HTTP front end calls it to
    refuse bad input before admission); `compile` may run on any thread and raises
    `InvalidRequestError` naming `params.param` for a constraint it cannot compile;
    `mask` mutates `logits` rows in place (minus infinity where a token is not allowed).
    """

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
    def mask(self, logits: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None: ...


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
        import xgrammar as xgr

        builders: dict[str, Callable[[Any], Any]] = {
            "json": lambda v: xgr.Grammar.from_json_schema(_schema_text(params),
                                                           any_whitespace=False),
            "regex": xgr.Grammar.from_regex,
            "choice": lambda v: xgr.Grammar.from_ebnf(choice_ebnf(v)),
            "grammar": xgr.Grammar.from_ebnf,
            "structural_tag": xgr.Grammar.from_structural_tag,
            "json_object": lambda v: None,
        }
        try:
            builders[params.kind](params.key[1])
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
            "structural_tag": lambda: c.compile_structural_tag(value),
        }
        try:
            return compilers[params.kind]()
        except Exception as exc:
            raise _invalid(params, exc) from None

    def matcher(self, compiled: Any) -> Matcher:
        return self._xgr.GrammarMatcher(compiled)  # type: ignore[no-any-return]

    def mask(self, logits: torch.Tensor, matchers: list[Matcher], rows: list[int]) -> None:
        import torch

        batch = logits.shape[0]  # bitmask rows line up with logits rows (`indices`)
        if batch > self._bitmask.shape[0]:
            self._bitmask = self._xgr.allocate_token_bitmask(batch, self.vocab_size)
        bitmask = self._bitmask[:batch]
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask,  # type: ignore[arg-type]
                                                 indices=rows)
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


BACKENDS: dict[str, type[GrammarBackend]] = {"xgrammar": XGrammarBackend}


def check_constraint(params: StructuredOutputsParams, backend: str = "xgrammar") -> None:
    """The front end's quick check of a constraint (400 naming its field)."""
    if params.json is not None:
        try:
            json.loads(params.json)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                      param=params.param) from None
    BACKENDS[backend].check(params)


# --------------------------------------------------------------------------- the manager


def _lowest_cpu_priority() -> None:
    """Run this (compile) thread at nice 19, so the forward pass's threads win the cores
    (Linux sets nice per thread; elsewhere this does nothing). It cannot win the GIL back:
    xgrammar holds it while compiling."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


@dataclass
class _Pending:
    request: Request
    future: Future[Any]
    deadline: float


class StructuredOutputManager:
    """The core's structured-output state: compile cache, requests waiting for their
    grammar, and the per-step mask. Used from the core's thread only (compiles run on
    this object's own executor)."""

    def __init__(self, config: StructuredOutputsConfig,
                 make_backend: Callable[[], GrammarBackend]) -> None:
        self.timeout = config.structured_outputs_compile_timeout
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiled: OrderedDict[tuple[str, Any], Future[Any]] = OrderedDict()
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

    def _compile_async(self, params: StructuredOutputsParams) -> Future[Any]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-grammar",
                                                initializer=_lowest_cpu_priority)
        future = self._compiled[params.key] = self._executor.submit(self._compile, params)
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
        return self._backend.compile(params)

    def poll(self, now: float) -> tuple[list[Request], list[tuple[str, SluiceError]]]:
        """Requests whose grammar is ready (matchers attached to every sequence), and
        requests that failed: a compile error, or the timeout."""
        ready: list[Request] = []
        failed: list[tuple[str, SluiceError]] = []
        for rid, p in list(self._pending.items()):
            if self._backend is None:  # loading the backend (seconds, once) is not compiling
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

    def _attach(self, request: Request, compiled: Any) -> SluiceError | None:
        """A matcher per sequence, advanced past the tokens a resumed (migrated) request
        already generated, so the grammar continues where the other worker left it."""
        assert self._backend is not None
        for seq in request.seqs:
            seq.grammar = self._backend.matcher(compiled)
            for token in seq.output_token_ids:
                if not seq.grammar.accept_token(token):
                    params = request.params.structured_outputs
                    return InvalidRequestError(
                        f"resumed token {token} does not match the constraint",
                        param=params.param if params else None)
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
    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask the rows of constrained sequences (one batched fill); no-op otherwise."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return
        assert self._backend is not None
        start = time.perf_counter()
        self._backend.mask(logits, [seqs[i].grammar for i in rows], rows)
        self.mask_samples.append((time.perf_counter() - start, len(rows)))

    @staticmethod
    def accept(seq: Sequence, token: int) -> None:
        """Advance the sequence's matcher; a token the grammar refuses (impossible after
        the mask, unless the model's vocabulary outgrows the tokenizer's) ends it."""
        if not seq.grammar.accept_token(token):
            log.error("grammar refused token %d of request %s", token, seq.request_id)
            seq.finish_reason = "stop"

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
