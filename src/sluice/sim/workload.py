"""What the simulator replays: the bench's seeded workloads and Mooncake traces, as token ids.

Synthetic workloads (`random`, `shared-prefix`, `multi-turn`) are the very classes of
`sluice.bench.workloads`, over a synthetic vocabulary (id i is "word" i: the simulator
needs token ids, never text), with arrivals from `sluice.bench.load` (Poisson/gamma at
`--request-rate`, or all at once). A trace replays its own timestamps (times
`time_scale`: 0.5 replays twice as fast) and its prompts come from the bench's
`BlockSynthesizer`, so equal hash-id prefixes are equal token prefixes, without building
the text the HTTP benchmark needs.

A turn's prompt is what `sluice bench serve` sends: the system prompt, then every
earlier user turn followed by the answer the server gave, then this turn's user text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

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
from sluice.protocol.errors import InvalidRequestError

VOCAB_SIZE = 32_000
SYNTHETIC = ("random", "shared-prefix", "multi-turn")


def synthetic_vocab(size: int = VOCAB_SIZE) -> Vocab:
    return Vocab(words=tuple(f"w{i}" for i in range(size)), ids=tuple(range(size)))


@dataclass
class TraceSessions:
    """A Mooncake trace as sessions of token ids (one single-turn session per row)."""

    rows: list[TraceRow]
    cfg: WorkloadConfig

    def __post_init__(self) -> None:
        block_len = max(1, round(512 * self.cfg.token_scale))
        max_id = max((max(r.hash_ids) for r in self.rows if r.hash_ids), default=0)
        self.synth = BlockSynthesizer(VOCAB_SIZE, block_len, max_id, self.cfg.seed)
        self.t0 = min((r.timestamp_ms for r in self.rows), default=0.0)

    def session(self, i: int) -> tuple[Session, float]:
        row = self.rows[i]
        if not row.hash_ids:
            raise InvalidRequestError(f"trace row {i} has no hash_ids", param="trace")
        ids = tuple(self.synth.prompt(row.hash_ids, row.input_length, self.cfg.token_scale))
        n_out = max(1, round(row.output_length * self.cfg.output_token_scale))
        at = (row.timestamp_ms - self.t0) / 1000.0 * self.cfg.time_scale
        turn = Turn(Segment(text="", num_tokens=len(ids), ids=ids), n_out)
        return Session(index=i, turns=(turn,), arrival=at), at

    def timed(self) -> Iterator[tuple[Session, float]]:
        return (self.session(i) for i in range(len(self.rows)))


def trace_sessions(path: str, cfg: WorkloadConfig, limit: int | None = None) -> TraceSessions:
    rows = load_trace(path)
    return TraceSessions(rows[:limit] if limit else rows, cfg)


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
