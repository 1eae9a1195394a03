"""A snapshot of the engine's state and counters, read by the worker's /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
