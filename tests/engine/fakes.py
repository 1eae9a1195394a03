"""A model-free runner that really uses the paged KV layout, for engine-loop tests.

`PagedFakeRunner.execute` writes each new token into its slot
(`block_table[pos // bs] * bs + pos % bs`) and computes a chunk's logits from the
context it *reads back from those slots*. A wrong block table, a stale prefix-cache hit
or a bad recompute after preemption therefore changes the logits, and the greedy output
no longer matches `reference_greedy`, which works on the plain token list.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

VOCAB = 64


def fake_logits(context: Sequence[int]) -> torch.Tensor:
    digest = hashlib.blake2b(repr(list(context)).encode(), digest_size=6).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
    return torch.randn(VOCAB, generator=gen) * 3.0


def reference_greedy(prompt: list[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(int(fake_logits(context).argmax()))
    return context[len(prompt):]


class FakeTokenizer:
    """Token i (1..63) is one letter; 0 is the end-of-sequence token (decodes to nothing)."""

    vocab_size = VOCAB
    bos_token_id = None

    def __init__(self, eos_token_ids: set[int] | None = None) -> None:
        self.eos_token_ids = {0} if eos_token_ids is None else eos_token_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + (ord(c) - 97) % 26 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + (i - 1) % 26) for i in ids
                       if not (skip_special_tokens and i in self.eos_token_ids))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.decode([i], False) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)


class PagedFakeRunner:
    def __init__(self, num_kv_blocks: int = 64, block_size: int = 4, max_model_len: int = 128,
                 tokenizer: FakeTokenizer | None = None, step_delay: float = 0.0) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = VOCAB
        self.tokenizer = tokenizer or FakeTokenizer()
        self.model_name = "fake"
        self.rope_variant = ""
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.num_calls = 0
        self.step_delay = step_delay  # seconds per execute: lets tests act mid-request
        self.logits_fn = fake_logits  # context -> logits (tests may swap in another model)

    def _slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, chunks: list[Any]) -> torch.Tensor:
        self.num_calls += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        rows = []
        for c in chunks:
            assert c.token_ids and len(c.block_table) * self.block_size >= c.start_pos + len(
                c.token_ids)
            for i, tok in enumerate(c.token_ids):
                self.slots[self._slot(c.block_table, c.start_pos + i)] = (c.start_pos + i, tok)
            if c.need_logits:  # speculative verify: the last num_logits tokens' rows
                context = self._read_context(c)
                for cut in range(getattr(c, "num_logits", 1) - 1, -1, -1):
                    rows.append(self.logits_fn(context[:len(context) - cut]))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)

    def _read_context(self, c: Any) -> list[int]:
        context = []
        for pos in range(c.start_pos + len(c.token_ids)):
            stored_pos, tok = self.slots[self._slot(c.block_table, pos)]
            assert stored_pos == pos, "KV slot holds another position"
            context.append(tok)
        return context


def run_all(engine: Any, max_steps: int = 5000) -> dict[str, Any]:
    """Step `engine` (an LLMEngine) until every request finished: request id -> its final
    RequestOutput; fails after `max_steps` steps."""
    final: dict[str, Any] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("engine did not finish")
