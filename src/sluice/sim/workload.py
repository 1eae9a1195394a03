"""What the simulator replays: the bench's seeded workloads and Mooncake traces, as token ids.

Synthetic workloads (`random`, `shared-prefix`, `multi-turn`) are the very classes of
`sluice.bench.workloads`, over a synthetic vocabulary (id i is "word" i: the simulator
needs token ids, never text), with arrivals from `sluice.bench.load` (Poisson/gamma at
`--request-rate`, or all at once). A trace replays its own timestamps (times
`time_scale`: 0.5 replays twice as fast) and its prompts come from the bench's
`BlockSynthesizer`, so equal hash-id prefixes are equal token prefixes, without building
the text the HTTP benchmark needs.

A trace can be reshaped to a day's rate (`DailyShape`): the rows keep their order,
lengths and hash ids, and row i, at fraction u_i of the trace's span, arrives when the
day's cumulative demand reaches u_i. The trace's own burstiness is kept, its mean rate
follows the day:

    rate(t) = mean × (1 − a·cos(2πt / D)),   a = (1 − r) / (1 + r),  r = trough / peak
    trough at t = 0 and t = D, peak at D / 2; peak / mean = 1 + a (1.6 at r = 1/4)

A turn's prompt is what `sluice bench serve` sends: the system prompt, then every
earlier user turn followed by the answer the server gave, then this turn's user text.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from sluice.bench.load import LoadConfig, schedule
from sluice.bench.tokens import Vocab
from sluice.bench.workloads import (
    WORKLOADS,
    BlockSynthesizer,
    Segment,
    Session,
    TraceRow,
    Turn,
    WorkloadConfig,
    build_workload,
    load_trace,
)
from sluice.protocol.block_hash import hash_block
from sluice.protocol.errors import InvalidRequestError

VOCAB_SIZE = 32_000
SYNTHETIC = ("random", "shared-prefix", "multi-turn")


def synthetic_vocab(size: int = VOCAB_SIZE) -> Vocab:
    return Vocab(words=tuple(f"w{i}" for i in range(size)), ids=tuple(range(size)))


@dataclass(frozen=True)
class DailyShape:
    """A day compressed into `duration_s`: the rate is a sinusoid with trough/peak
    `trough_ratio`, lowest at 0 and `duration_s`, highest at `duration_s / 2`."""

    duration_s: float
    trough_ratio: float = 0.25

    def __post_init__(self) -> None:
        if not 0 < self.duration_s < math.inf:
            raise InvalidRequestError("duration must be > 0 and finite", param="duration")
        if not 0 < self.trough_ratio <= 1:
            raise InvalidRequestError("trough_ratio must be in (0, 1]", param="trough_ratio")

    @property
    def amplitude(self) -> float:
        return (1 - self.trough_ratio) / (1 + self.trough_ratio)

    def relative_rate(self, t: float) -> float:
        """The rate at `t` over the day's mean (1 + a at the peak, 1 - a at the trough)."""
        return 1 - self.amplitude * math.cos(2 * math.pi * t / self.duration_s)

    def demand(self, t: np.ndarray) -> np.ndarray:
        """The fraction of the day's requests that arrived by `t` (0 .. 1, increasing)."""
        d, w = self.duration_s, 2 * math.pi / self.duration_s
        return (t - self.amplitude * np.sin(w * t) / w) / d

    def times(self, fractions: np.ndarray) -> np.ndarray:
        """When the cumulative demand reaches each of `fractions` (its inverse, by
        interpolation on a grid of 1/10,000 of the day: exact to ~1e-8 of the day)."""
        grid = np.linspace(0.0, self.duration_s, 10_001)
        return np.interp(fractions, self.demand(grid), grid)


@dataclass(frozen=True)
class KeyedSegment(Segment):
    """A trace prompt that also names its full blocks: block i (`ids[i * block_len :
    (i + 1) * block_len]`) is `BlockSynthesizer.block(block_keys[i])`, a pure function of
    the key. `block_hashes` are those blocks' chained hashes (`hash_block`, no salt), which
    the simulator takes when its block size is `block_len`: a block's hash is a function of
    its parent's and its key, so the trace hashes each (parent, key) pair once, when it
    is built, not once per run and prompt (two thirds of the trace's blocks repeat)."""

    block_len: int = 0
    block_keys: tuple[int, ...] = ()
    block_hashes: tuple[int, ...] = ()


class SharedIdsSynthesizer(BlockSynthesizer):
    """`BlockSynthesizer` whose blocks hold the vocabulary's own int objects (equal ids,
    the same objects), not one fresh int per token of each new block.

    Only for speed: the trace's ~20M distinct-block tokens are otherwise ~20M int objects
    spread over ~0.6 GB, and every copy of a prompt's ids (the engine caching a block, a
    KV event's tokens, a turn's prompt) touches each of them; 32,000 shared ones stay in
    the CPU's caches. Values, and so every result, are the same."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._ids = tuple(range(self.vocab_size))

    def block(self, h: int) -> tuple[int, ...]:
        got = self._cache.get(h)
        if got is None:
            got = self._cache[h] = tuple(map(self._ids.__getitem__, super().block(h)))
        return got


@dataclass
class TraceSessions:
    """A Mooncake trace as sessions of token ids (one single-turn session per row), at its
    own times (times `time_scale`) or re-timed to `shape`."""

    rows: list[TraceRow]
    cfg: WorkloadConfig
    shape: DailyShape | None = None
    arrivals: np.ndarray = field(init=False)  # seconds, one per row

    def __post_init__(self) -> None:
        block_len = max(1, round(512 * self.cfg.token_scale))
        max_id = max((max(r.hash_ids) for r in self.rows if r.hash_ids), default=0)
        self.synth = SharedIdsSynthesizer(VOCAB_SIZE, block_len, max_id, self.cfg.seed)
        self.hashes: dict[tuple[int | None, int], int] = {}  # (parent, block key) -> hash
        stamps = np.array([r.timestamp_ms for r in self.rows], dtype=float)
        offsets = stamps - stamps.min() if len(stamps) else stamps
        if self.shape is None:
            self.arrivals = offsets / 1000.0 * self.cfg.time_scale
        else:
            span = offsets.max() if len(offsets) and offsets.max() > 0 else 1.0
            self.arrivals = self.shape.times(offsets / span)

    def session(self, i: int) -> tuple[Session, float]:
        row = self.rows[i]
        if not row.hash_ids:
            raise InvalidRequestError(f"trace row {i} has no hash_ids", param="trace")
        ids = tuple(self.synth.prompt(row.hash_ids, row.input_length, self.cfg.token_scale))
        n_out = max(1, round(row.output_length * self.cfg.output_token_scale))
        at = float(self.arrivals[i])
        bl = self.synth.block_len  # blocks past the full ones: the cut last one
        keys = tuple(row.hash_ids[:len(ids) // bl])
        turn = Turn(KeyedSegment(text="", num_tokens=len(ids), ids=ids, block_len=bl,
                                 block_keys=keys, block_hashes=self._chain(ids, keys)), n_out)
        return Session(index=i, turns=(turn,), arrival=at), at

    def _chain(self, ids: tuple[int, ...], keys: tuple[int, ...]) -> tuple[int, ...]:
        """`hash_blocks` of the keyed blocks of `ids`, each (parent, key) hashed once."""
        bl, memo = self.synth.block_len, self.hashes
        out: list[int] = []
        parent: int | None = None
        for i, key in enumerate(keys):
            h = memo.get((parent, key))
            if h is None:
                h = memo[parent, key] = hash_block(parent, ids[i * bl:(i + 1) * bl])
            out.append(h)
            parent = h
        return tuple(out)

    def timed(self) -> Iterator[tuple[Session, float]]:
        return (self.session(i) for i in range(len(self.rows)))


def trace_sessions(path: str, cfg: WorkloadConfig, limit: int | None = None,
                   shape: DailyShape | None = None) -> TraceSessions:
    rows = load_trace(path)
    return TraceSessions(rows if limit is None else rows[:limit], cfg, shape)


def synthetic_sessions(name: str, cfg: WorkloadConfig, load: LoadConfig, count: int
                       ) -> list[tuple[Session, float]]:
    """`count` sessions of a bench workload, each with its start offset in seconds."""
    if name not in SYNTHETIC:
        raise InvalidRequestError(f"unknown workload {name!r}; the simulator runs "
                                  f"{[*SYNTHETIC, 'trace']}", param="workload")
    if count < 1:
        raise InvalidRequestError("num_prompts must be >= 1", param="num_prompts")
    assert name in WORKLOADS
    workload = build_workload(name, cfg, synthetic_vocab(), _NoEncoder())
    sessions = (s for s, _ in zip(workload.sessions(), range(count), strict=False))
    return list(schedule(sessions, load, use_trace_times=False))


class _NoEncoder:
    """Synthetic workloads never encode text (only sharegpt does, which needs a tokenizer)."""

    def encode(self, text: str) -> list[int]:
        raise InvalidRequestError("the simulator has no tokenizer", param="workload")

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        raise InvalidRequestError("the simulator has no tokenizer", param="workload")


def turn_prompt(session: Session, k: int, answers: Sequence[Sequence[int]]) -> list[int]:
    """Token ids of turn `k`: system, (user, answer) for each earlier turn, user `k`."""
    out: list[int] = list(_ids(session.system)) if session.system is not None else []
    for j in range(k):
        out.extend(_ids(session.turns[j].user))
        out.extend(answers[j])
    out.extend(_ids(session.turns[k].user))
    return out


def _ids(seg: Segment) -> tuple[int, ...]:
    if seg.ids is None:
        raise InvalidRequestError("a simulated prompt needs token ids", param="workload")
    return seg.ids
