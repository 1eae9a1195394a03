"""Seeded, reproducible workloads: what to send, independent of when and where.

Every workload yields `Session`s; a single-prompt request is a one-turn session, a chat
is a session of several turns whose history grows with the server's answers. Session
`i` is a pure function of `(seed, i)` (numpy's `default_rng([seed, stream, i])`), so
the same seed gives the same workload against every endpoint in a `--compare`, and
synthetic workloads can be drawn lazily for `--duration` runs.

| name          | shape                                                                 |
| ------------- | --------------------------------------------------------------------- |
| random        | input/output lengths fixed or drawn (uniform, normal, lognormal)     |
| shared-prefix | G groups, each a system prompt of L tokens, plus Q-token questions    |
| multi-turn    | S chat sessions of T turns; each turn resends the growing history     |
| trace         | a Mooncake JSONL (timestamp ms, lengths, hash_ids of 512-token blocks)|
| sharegpt      | a ShareGPT JSON file (first human turn → prompt, reply → output len)  |

Trace synthesis, hash id `h` → a block of `B = max(1, round(512 * token_scale))` tokens:

    block(h) = [ digit_0(h) digit_1(h) .. digit_{k-1}(h) | r_k .. r_{B-1} ]
                 base-|vocab| digits of h,                  seeded by (seed, h)
                 each through a seeded permutation

so equal ids give equal blocks, different ids differ within the first k tokens
(k = digits needed for the largest id), and a prompt is its blocks concatenated, the
last one cut to the (scaled) `input_length`: equal hash-id prefixes ⇔ equal token
prefixes of the corresponding length.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from sluice.bench.tokens import TextEncoder, Vocab
from sluice.protocol.errors import InvalidRequestError

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Segment:
    """A piece of prompt: its text, and its token ids when they are known exactly."""

    text: str
    num_tokens: int
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Turn:
    user: Segment
    output_len: int


@dataclass(frozen=True)
class Session:
    """One conversation: a single request, or several turns sent one after another."""

    index: int
    turns: tuple[Turn, ...]
    system: Segment | None = None
    arrival: float | None = None  # seconds from the start (trace replay), else None
    session_id: str | None = None

    @property
    def multi_turn(self) -> bool:
        return len(self.turns) > 1


@dataclass(frozen=True)
class WorkloadConfig:
    """Every workload option; each workload reads only the ones named in its spec."""

    seed: int = 0
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    length_dist: str = "uniform"
    num_groups: int = 4
    system_prompt_len: int = 0
    num_turns: int = 4
    trace_path: str | None = None
    token_scale: float = 1.0
    output_token_scale: float = 1.0
    time_scale: float = 1.0
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None  # None: the dataset reply's length

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len", "num_groups", "num_turns"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", param=name)
        for name in ("token_scale", "output_token_scale", "time_scale"):
            if not 0 < getattr(self, name) < math.inf:
                raise InvalidRequestError(f"{name} must be > 0 and finite", param=name)
        if not 0 <= self.range_ratio < math.inf:
            raise InvalidRequestError("range_ratio must be >= 0 and finite", param="range_ratio")
        if self.length_dist not in LENGTH_DISTS:
            raise InvalidRequestError(
                f"length_dist must be one of {sorted(LENGTH_DISTS)}", param="length_dist"
            )
        if self.length_dist == "uniform" and self.range_ratio >= 1:
            # [L(1-r), L(1+r)] would reach below one token, where every draw is one token
            raise InvalidRequestError(
                f"range_ratio must be < 1 for uniform lengths in [L(1-r), L(1+r)], got "
                f"{self.range_ratio:g} (normal and lognormal take any spread)", param="range_ratio"
            )


# ---------------------------------------------------------------- lengths


def _uniform(rng: np.random.Generator, mean: int, ratio: float) -> int:
    lo, hi = math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))
    return int(rng.integers(lo, hi + 1)) if hi > lo else mean


def _normal(rng: np.random.Generator, mean: int, ratio: float) -> int:
    return round(rng.normal(mean, mean * ratio)) if ratio > 0 else mean


def _lognormal(rng: np.random.Generator, mean: int, ratio: float) -> int:
    if ratio <= 0:
        return mean
    mu = math.log(mean) - ratio**2 / 2  # so that the mean is `mean`
    return round(rng.lognormal(mu, ratio))


LENGTH_DISTS: dict[str, Callable[[np.random.Generator, int, float], int]] = {
    "uniform": _uniform,
    "normal": _normal,
    "lognormal": _lognormal,
}


def draw_length(rng: np.random.Generator, cfg: WorkloadConfig, mean: int) -> int:
    return max(1, LENGTH_DISTS[cfg.length_dist](rng, mean, cfg.range_ratio))


def random_segment(rng: np.random.Generator, vocab: Vocab, n: int) -> Segment:
    idx = rng.integers(0, len(vocab), size=n).tolist()
    return Segment(text=vocab.text(idx), num_tokens=n, ids=vocab.token_ids(idx))


# ---------------------------------------------------------------- workloads

# stream numbers keep each purpose's random draws independent of the others
_RANDOM, _GROUP_SYSTEM, _GROUP_QUESTION, _CHAT, _SHUFFLE, _BLOCK_PERM, _BLOCK_FILL = range(1, 8)


@dataclass(frozen=True)
class RandomWorkload:
    cfg: WorkloadConfig
    vocab: Vocab

    def session(self, i: int) -> Session:
        rng = np.random.default_rng([self.cfg.seed, _RANDOM, i])
        n_in = draw_length(rng, self.cfg, self.cfg.input_len)
        n_out = draw_length(rng, self.cfg, self.cfg.output_len)
        return Session(index=i, turns=(Turn(random_segment(rng, self.vocab, n_in), n_out),))

    def sessions(self) -> Iterator[Session]:
        return map(self.session, itertools.count())


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """inference-perf's shared-prefix shape: groups share a system prompt."""

    cfg: WorkloadConfig
    vocab: Vocab

    def __post_init__(self) -> None:
        if self.cfg.system_prompt_len < 1:
            raise InvalidRequestError("shared-prefix needs --system-prompt-len >= 1", param="system_prompt_len")

    def system(self, group: int) -> Segment:
        rng = np.random.default_rng([self.cfg.seed, _GROUP_SYSTEM, group])
        return random_segment(rng, self.vocab, self.cfg.system_prompt_len)

    def session(self, i: int) -> Session:
        rng = np.random.default_rng([self.cfg.seed, _GROUP_QUESTION, i])
        group = int(rng.integers(0, self.cfg.num_groups))
        question = random_segment(rng, self.vocab, self.cfg.input_len)
        turn = Turn(question, self.cfg.output_len)
        return Session(index=i, turns=(turn,), system=self.system(group), session_id=f"g{group}")

    def sessions(self) -> Iterator[Session]:
        return map(self.session, itertools.count())


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Chat sessions: each turn adds a user message of `input_len` tokens."""

    cfg: WorkloadConfig
    vocab: Vocab

    def session(self, i: int) -> Session:
        rng = np.random.default_rng([self.cfg.seed, _CHAT, i])
        system = None
        if self.cfg.system_prompt_len > 0:
            system = random_segment(rng, self.vocab, self.cfg.system_prompt_len)
        turns = tuple(
            Turn(
                random_segment(rng, self.vocab, draw_length(rng, self.cfg, self.cfg.input_len)),
                draw_length(rng, self.cfg, self.cfg.output_len),
            )
            for _ in range(self.cfg.num_turns)
        )
        return Session(index=i, turns=turns, system=system, session_id=f"s{self.cfg.seed}-{i}")

    def sessions(self) -> Iterator[Session]:
        return map(self.session, itertools.count())


@dataclass(frozen=True)
class TraceRow:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path) -> list[TraceRow]:
    try:
        with open(path, encoding="utf-8") as fh:
            rows = [_trace_row(line, path, n) for n, line in enumerate(fh, 1) if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read trace file {path}: {exc}", param="trace") from exc
    if not rows:
        raise InvalidRequestError(f"{path} holds no Mooncake trace rows", param="trace")
    return rows


def _trace_row(line: str, path: str | Path, lineno: int) -> TraceRow:
    try:
        d = json.loads(line)
        row = TraceRow(
            float(d["timestamp"]),
            int(d["input_length"]),
            int(d["output_length"]),
            tuple(int(h) for h in d["hash_ids"]),
        )
        if not 0 <= row.timestamp_ms < math.inf:
            raise ValueError(f"timestamp {row.timestamp_ms} is not a time >= 0")
        if row.input_length < 1 or row.output_length < 1:
            raise ValueError("input_length and output_length must be >= 1")
        return row
    except (KeyError, ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"{path}:{lineno}: not a Mooncake trace row ({exc})", param="trace"
        ) from exc


@dataclass
class BlockSynthesizer:
    """Hash id → a deterministic block of token indices (see the module docstring)."""

    vocab_size: int
    block_len: int
    max_id: int
    seed: int
    _cache: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.digits = 1
        while self.vocab_size**self.digits <= self.max_id:
            self.digits += 1
        if self.digits > self.block_len:
            raise InvalidRequestError(
                f"a {self.block_len}-token block cannot tell {self.max_id + 1} hash ids "
                f"apart with {self.vocab_size} words; raise --token-scale",
                param="token_scale",
            )
        rng = np.random.default_rng([self.seed, _BLOCK_PERM])
        self._perms = [rng.permutation(self.vocab_size) for _ in range(self.digits)]

    def block(self, h: int) -> tuple[int, ...]:
        if h not in self._cache:
            digits = [(h // self.vocab_size**j) % self.vocab_size for j in range(self.digits)]
            head = [int(self._perms[j][d]) for j, d in enumerate(digits)]
            rng = np.random.default_rng([self.seed, _BLOCK_FILL, h])
            tail = rng.integers(0, self.vocab_size, size=self.block_len - self.digits).tolist()
            self._cache[h] = tuple(head + tail)
        return self._cache[h]

    def prompt(self, hash_ids: Sequence[int], input_length: int, scale: float) -> list[int]:
        """Full blocks for all but the last id; the last cut to the scaled remainder."""
        rest = input_length - TRACE_BLOCK_TOKENS * (len(hash_ids) - 1)
        last = min(self.block_len, max(1, math.ceil(rest * scale)))
        out: list[int] = []
        for h in hash_ids[:-1]:
            out.extend(self.block(h))
        out.extend(self.block(hash_ids[-1])[:last])
        return out


@dataclass
class TraceWorkload:
    cfg: WorkloadConfig
    vocab: Vocab
    rows: list[TraceRow]

    def __post_init__(self) -> None:
        block_len = max(1, round(TRACE_BLOCK_TOKENS * self.cfg.token_scale))
        max_id = max((max(r.hash_ids) for r in self.rows if r.hash_ids), default=0)
        self.synth = BlockSynthesizer(len(self.vocab), block_len, max_id, self.cfg.seed)
        self.t0 = min((r.timestamp_ms for r in self.rows), default=0.0)

    def session(self, i: int) -> Session:
        row = self.rows[i]
        if not row.hash_ids:
            raise InvalidRequestError(f"trace row {i} has no hash_ids", param="trace")
        idx = self.synth.prompt(row.hash_ids, row.input_length, self.cfg.token_scale)
        seg = Segment(text=self.vocab.text(idx), num_tokens=len(idx), ids=self.vocab.token_ids(idx))
        n_out = max(1, round(row.output_length * self.cfg.output_token_scale))
        arrival = (row.timestamp_ms - self.t0) / 1000.0 * self.cfg.time_scale
        return Session(index=i, turns=(Turn(seg, n_out),), arrival=arrival)

    def sessions(self) -> Iterator[Session]:
        return (self.session(i) for i in range(len(self.rows)))


@dataclass
class ShareGPTWorkload:
    """vLLM's ShareGPT sampling: seeded shuffle, first human turn, length filters."""

    cfg: WorkloadConfig
    encoder: TextEncoder
    pairs: list[tuple[str, str]]
    fixed_output_len: int | None = None

    def sessions(self) -> Iterator[Session]:
        order = np.random.default_rng([self.cfg.seed, _SHUFFLE]).permutation(len(self.pairs))
        i = 0
        for start in range(0, len(order), 64):
            batch = [self.pairs[j] for j in order[start : start + 64]]
            ins = self.encoder.encode_many([p for p, _ in batch])
            outs = self.encoder.encode_many([c for _, c in batch])
            for (prompt, _), pi, ci in zip(batch, ins, outs, strict=True):
                n_out = self.fixed_output_len or len(ci)
                if len(pi) < 4 or n_out < 4 or len(pi) > 1024 or len(pi) + n_out > 2048:
                    continue
                seg = Segment(text=prompt, num_tokens=len(pi))
                yield Session(index=i, turns=(Turn(seg, n_out),))
                i += 1


def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"cannot read ShareGPT file {path}: {exc}", param="dataset_path") from exc
    pairs = []
    for entry in data if isinstance(data, list) else []:
        conv = entry.get("conversations") or entry.get("conversation") or []
        if len(conv) >= 2 and isinstance(conv[0], dict) and isinstance(conv[1], dict):
            pairs.append((str(conv[0].get("value", "")), str(conv[1].get("value", ""))))
    if not pairs:
        raise InvalidRequestError(f"{path} holds no ShareGPT conversations", param="dataset_path")
    return pairs


# ---------------------------------------------------------------- registry


@dataclass(frozen=True)
class WorkloadSpec:
    """How to build a workload and which CLI options it reads (others are rejected)."""

    build: Callable[[WorkloadConfig, Vocab, TextEncoder], Workload]
    uses: frozenset[str]
    finite: bool = False


class Workload(Protocol):
    """Anything that yields sessions in a fixed, seeded order."""

    def sessions(self) -> Iterator[Session]: ...


def _build_trace(cfg: WorkloadConfig, vocab: Vocab, _enc: TextEncoder) -> TraceWorkload:
    if not cfg.trace_path:
        raise InvalidRequestError("--workload trace needs --trace FILE", param="trace")
    return TraceWorkload(cfg, vocab, load_trace(cfg.trace_path))


def _build_sharegpt(cfg: WorkloadConfig, _vocab: Vocab, enc: TextEncoder) -> ShareGPTWorkload:
    if not cfg.dataset_path:
        raise InvalidRequestError("--workload sharegpt needs --dataset-path FILE", param="dataset_path")
    return ShareGPTWorkload(cfg, enc, load_sharegpt(cfg.dataset_path), cfg.sharegpt_output_len)


_LENGTHS = frozenset({"input_len", "output_len", "range_ratio", "length_dist"})

WORKLOADS: dict[str, WorkloadSpec] = {
    "random": WorkloadSpec(lambda c, v, e: RandomWorkload(c, v), _LENGTHS),  # type: ignore[arg-type,return-value]
    "shared-prefix": WorkloadSpec(
        lambda c, v, e: SharedPrefixWorkload(c, v),  # type: ignore[arg-type,return-value]
        frozenset({"input_len", "output_len", "num_groups", "system_prompt_len"}),
    ),
    "multi-turn": WorkloadSpec(
        lambda c, v, e: MultiTurnWorkload(c, v),  # type: ignore[arg-type,return-value]
        _LENGTHS | {"num_turns", "system_prompt_len", "num_sessions"},
    ),
    "trace": WorkloadSpec(
        _build_trace,  # type: ignore[arg-type]
        frozenset({"trace_path", "token_scale", "output_token_scale", "time_scale"}),
        finite=True,
    ),
    "sharegpt": WorkloadSpec(
        _build_sharegpt,  # type: ignore[arg-type]
        frozenset({"dataset_path", "output_len"}),
        finite=True,
    ),
}


def build_workload(name: str, cfg: WorkloadConfig, vocab: Vocab, encoder: TextEncoder) -> Workload:
    if name not in WORKLOADS:
        raise InvalidRequestError(f"unknown workload {name!r}; one of {sorted(WORKLOADS)}", param="workload")
    return WORKLOADS[name].build(cfg, vocab, encoder)


def take(workload: Workload, n: int) -> list[Session]:
    """The first `n` sessions (fewer if a finite workload runs out)."""
    out: list[Session] = []
    for s in workload.sessions():
        if len(out) >= n:
            break
        out.append(s)
    return out
