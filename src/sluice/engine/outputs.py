"""What the engine returns: vLLM's `RequestOutput` / `CompletionOutput` shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

# One entry per generated token: {token_id: logprob} for the sampled token and the top-k.
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

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
