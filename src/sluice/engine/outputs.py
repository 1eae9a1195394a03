"""What the engine returns: vLLM's `RequestOutput` / `CompletionOutput` shapes."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# One entry per generated token: {token_id: logprob} for the sampled token and the top-k.
TokenLogprobs = dict[int, float]


class Logprob(float):
    """A logprob that is also vLLM's `Logprob` (`.logprob`, `.rank`, `.decoded_token`), as
    `LLM` hands them out: code written for vLLM (`lp[t].logprob`) and for sluice's floats
    (`lp[t]`, sums) both read it. `rank`: 1 for the most likely token; None for a sampled
    token outside the top `logprobs` (its rank is not computed)."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None,
                decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return (f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
                f"decoded_token={self.decoded_token!r})")

    def __reduce__(self) -> tuple[type[Logprob], tuple[float, int | None, str | None]]:
        return Logprob, (float(self), self.rank, self.decoded_token)


def ranked(entry: TokenLogprobs, top: int, decode: Callable[[int], str]) -> TokenLogprobs:
    """One token's entry (the sampled token first, then the `top` most likely) as
    `Logprob`s with ranks and decoded tokens, in the same order."""
    best = sorted(entry, key=lambda t: -entry[t])[:top]
    rank = {t: i + 1 for i, t in enumerate(best)}
    return {t: Logprob(v, rank.get(t), decode(t)) for t, v in entry.items()}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    # with SamplingParams.prediction: its drafted tokens accepted and refused so far
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # of all its sequences
    num_prefill_chunks: int = 0  # chunks the prompt took before the first token


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = field(default=None)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (vLLM's shape); in a DELTA stream, in the first output only
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # vLLM's `EmbeddingOutput.embedding`


@dataclass
class ClassificationOutput:
    probs: list[float]  # vLLM's: one score a label (softmax, or sigmoids)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """vLLM's `LLM.classify` answer for one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float  # vLLM's: a cross-encoder's score of the pair, or two embeddings' cosine


@dataclass
class ScoringRequestOutput:
    """vLLM's `LLM.score` answer for one pair."""

    request_id: str
    prompt_token_ids: list[int]  # a cross-encoder's pair; an embedding model's second text
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    data: Any  # vLLM's: a float32 torch tensor, (width,), or (prompt tokens, width)


@dataclass
class PoolingRequestOutput:
    """vLLM's `LLM.encode` answer for one prompt: its pooled data, as its task asks."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput`: one prompt's embedding (`outputs.embedding`), its
    last token's final hidden state, L2-normalized. `data`: the same vector as
    little-endian float32 bytes (what `/v1/embeddings` sends for `encoding_format:
    base64`)."""

    request_id: str
    prompt_token_ids: list[int]
    data: bytes
    num_cached_tokens: int = 0
    finished: bool = True

    @property
    def outputs(self) -> EmbeddingOutput:
        return EmbeddingOutput(array("f", self.data).tolist())
