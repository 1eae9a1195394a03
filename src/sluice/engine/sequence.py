"""A sequence: one completion's tokens and how far the KV cache has caught up with them.

There is no prefill or decode phase (vLLM v1): a sequence holds `token_ids` (prompt,
then generated tokens) and `num_computed_tokens`, the prefix whose K/V are in the cache.
Each step the scheduler gives it a chunk of the rest; when the chunk reaches the last
token the model's logits for it are sampled and one token is appended:

    token_ids:  [p0 p1 p2 p3 p4 p5 | g0 g1]         num_tokens = 8
                 <---- computed ----> ^             num_computed_tokens = 7
                                      next chunk = [g1] (a "decode")

A request with `n > 1` owns `n` sequences that share the prompt (the prefix cache lets
the later ones reuse the first one's full prompt blocks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.engine.outputs import RequestMetrics, TokenLogprobs
from sluice.engine.pooling_params import TOKEN_LEVEL

if TYPE_CHECKING:
    import torch

    from sluice.engine.lora import LoRAAdapter, LoRARequest
    from sluice.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable per-completion state; owned by the scheduler while unfinished."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_tokens: int  # effective: params.max_tokens, or up to max_model_len
    priority: int = 0
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full computed blocks
    num_cached_tokens: int = -1  # prompt tokens served by the prefix cache on first schedule
    generator: torch.Generator | None = None  # reseeded per token from (seed, position)
    seed: int | None = None  # the request's seed + index
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    # prompt_logprobs: one entry per prompt position computed so far (None for the first
    # token, which nothing predicts); sequence 0 of its request only
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id (stop strings are the front end's)
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # chunks scheduled before the first token (traces)
    grammar: Any = None  # structured output: this sequence's matcher (structured_output.py)
    # a reasoning model's: while set, the grammar waits for the thinking to end
    # (structured_output.Thinking); None: the grammar holds (or there is none)
    thinking: Any = None
    lora: LoRARequest | None = None  # multi-LoRA: the adapter it runs with
    adapter: LoRAAdapter | None = None  # its weights (held while the sequence lives)
    # keys its KV in the prefix cache beside the tokens: the adapter's content hash
    cache_salt: bytes = b""
    lora_id: int | None = None  # in KV events (vLLM's BlockStored.lora_id)
    # chained hashes (`hash_block` with `cache_salt`) of the prompt's first full blocks,
    # when the caller has them already (the simulator's router hashed the prompt): the
    # block manager takes them instead of hashing those blocks again. Prompt blocks only:
    # they never change (generated tokens can be taken back: speculative decoding).
    known_block_hashes: tuple[int, ...] = ()
    # an embedding: its prompt's final hidden states pooled (sluice.engine.pooling's type),
    # nothing sampled; "" for a generation. `pooled`: the pooled row so far (float32)
    pooling: str = ""
    pooled: Any = None
    use_activation: bool | None = None  # its PoolingParams' (None: the pooler's default)
    # predicted outputs (`params.prediction`): its drafted tokens the verify accepted and
    # those it refused (OpenAI's accepted_ / rejected_prediction_tokens)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position's output is wanted (prompt logprobs, MEAN, CLS or a token
        task's ALL pooling): no prefix-cache hits."""
        return self.wants_prompt_logits or self.pooling in ("MEAN", "CLS", TOKEN_LEVEL)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether some prompt position still needs its logprob: every computed token's
        logits are wanted, and the prefix cache is not looked up."""
        return self.prompt_logprobs is not None \
            and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self, use_priority: bool) -> tuple[int, float, int]:
        """Scheduling order: lower runs first; ties by arrival, then by admission order."""
        return (self.priority if use_priority else 0, self.arrival_time, self.seq_id)


@dataclass(eq=False)
class Request:
    """A client request: the prompt, its parameters and its `n` sequences.

    Sequence 0 is scheduled at once; siblings (n > 1) join the scheduler once sequence 0
    has computed the prompt, so they find its full blocks in the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    siblings_pending: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
