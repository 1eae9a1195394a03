"""A snapshot of the engine's state and counters, read by the worker's /metrics."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

# vLLM's buckets for vllm:iteration_tokens_total (upper bounds, inclusive; then +Inf)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class IterationTokens:
    """vLLM's `vllm:iteration_tokens_total`: a histogram of the tokens of each engine step
    that produced output, counted as vLLM counts them: the tokens generated in the step
    plus the whole prompt of each request whose first token it produced (so its sum
    grows as `vllm:prompt_tokens` + `vllm:generation_tokens` do). A step that only ran
    prompt chunks produces no output and is not observed, as in vLLM."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    total: int = 0

    def observe(self, tokens: int) -> None:
        """Count one step of `tokens` tokens (0: a step without output, not counted)."""
        if tokens > 0:
            self.counts[bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self.total += tokens


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use by live requests, 0..1
    num_kv_blocks: int
    # Cumulative counters since start (Prometheus counters).
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_steps: int
    # Offload tiers by medium ("CPU", "DISK", "REDIS"): kv_offload.TierStats fields.
    kv_offload: dict[str, dict[str, float]] = field(default_factory=dict)
    # multi-LoRA (vllm:lora_requests_info): adapter names, comma-separated
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    max_lora: int = 0  # --max-loras (0: LoRA off)
    # speculative decoding (SpecDecoder.stats): num_drafts, num_draft_tokens,
    # num_accepted_tokens, accepted_per_pos; empty when off
    spec_decode: dict[str, Any] = field(default_factory=dict)
    # P/D KV transfer (sluice.engine.kv_transfer.TransferStats): bytes/blocks sent and
    # received, held blocks, failures by reason, the pull-time histogram
    kv_transfer: dict[str, float] = field(default_factory=dict)
    # vllm:iteration_tokens_total: steps per ITERATION_TOKEN_BUCKETS bucket (not
    # cumulative; the last is +Inf), and the sum of their tokens
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
