"""Draft-model speculation: a smaller model with the target's vocabulary proposes greedily.

Each step, for the sequences the planner chose (k_i tokens each), in this order:

    catch up   one batched forward of each sequence's tokens the draft has not computed
               [t_c .. t] -> the logits at t -> d1 = argmax     (after a verify: 1-2 tokens;
               a new sequence: its whole prompt, once)
    draft      k-1 batched one-token forwards: d_j at its position -> d_{j+1} = argmax
    roll back  at the next step, by comparison: the draft's valid prefix is the verified
               tokens it had, plus the drafted tokens the target accepted; the slots of
               the rejected ones are written again before anything reads them

One sequence's draft state (block_size 4, k = 4):

    token_ids  [p0 p1 p2 p3 p4 p5 g0 g1]     verified (the target's)
    base = 8   the draft holds K/V of token_ids[:8]
    tail       [d1 d2 d3] : it also holds K/V of these drafts, at positions 8, 9, 10
    table      [3, 9, 4]  : blocks of the draft's own pool (12 slots >= 8 + k - 1)
    target accepts d1, then emits x:  token_ids [... g1 d1 x]  -> base = 9, tail = []

Why greedy: a greedy draft is a point mass given the context, so `SpecDecoder.verify`'s
rule (accept iff the plain sampler's sample equals the draft) is exact rejection
sampling at any temperature; outputs are plain decoding's, and seeded requests get the
very same tokens. A sampled draft distribution q with min(1, p/q) acceptance (more
accepted tokens at high temperature) is not built.

The draft model is loaded by the target's loader (any format the engine loads), in the
target's dtype and on its device, with the target's tokenizer; a draft whose vocabulary
differs (embedding rows, or its own tokenizer's token -> id map) is refused with an
error naming `speculative_config.model`. Its KV pool is its own ModelRunner's,
`draft_num_kv_blocks` blocks (default: the target pool's block count, which holds
every running sequence's context; the draft's blocks are smaller by its layer count).
When the pool is full, the least recently drafted other sequences' draft state is
dropped (they catch up again when next chosen); a sequence that still does not fit
does not draft. A finished or preempted sequence's draft blocks are freed.

Cost (`draft_seconds`, which the planner adds to the verify's): every draft forward is
timed into a `StepCost` (tokens -> seconds, calibrated at start on a real model); a
step of drafts costs one forward per depth over the sequences still drafting at that
depth. A new sequence's first catch-up over its prompt is an investment the planner
does not charge to one step.
"""

from __future__ import annotations

import time
from typing import Any

from sluice.engine.block_manager import blocks_needed
from sluice.engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from sluice.engine.model_runner import DTYPES, ModelRunner, SeqChunk
from sluice.engine.sequence import Sequence
from sluice.engine.spec_decode import Proposer, StepCost
from sluice.engine.tokenizer import load_tokenizer, resolve_model
from sluice.protocol.errors import InvalidRequestError

PARAM = "speculative_config.model"


def load_draft_runner(spec: SpeculativeConfig, engine: EngineConfig | None,
                      target: Any) -> ModelRunner:
    """The draft model in its own ModelRunner (own KV pool, no prefix cache, no LoRA),
    the target's dtype, device, block size, kernels and tokenizer; raises
    InvalidRequestError naming `speculative_config.model` if it does not load or its
    vocabulary is not the target's."""
    mc = engine.model if engine is not None else ModelConfig()
    gguf = str(spec.model).endswith(".gguf")
    config = EngineConfig(
        ModelConfig(model=spec.model, tokenizer=mc.tokenizer or resolve_model(mc.model),
                    dtype={v: k for k, v in DTYPES.items()}[target.dtype],
                    device=str(target.device), seed=mc.seed, kernel_backend=mc.kernel_backend,
                    quantization=mc.quantization if gguf else "none"),
        CacheConfig(block_size=target.block_size, enable_prefix_caching=False,
                    num_kv_blocks=spec.draft_num_kv_blocks or target.num_kv_blocks))
    try:
        runner = ModelRunner(config)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{PARAM} {spec.model!r} did not load: {exc}",
                                  param=PARAM) from exc
    check_same_vocab(spec.model, runner, target)
    return runner


def check_same_vocab(model: str | None, draft: Any, target: Any) -> None:
    """Refuse a draft whose vocabulary is not the target's: its embedding rows, and its
    own tokenizer's token -> id map when it ships one (else it uses the target's)."""
    if draft.vocab_size != target.vocab_size:
        raise InvalidRequestError(f"{PARAM} {model!r} has a vocabulary of {draft.vocab_size} "
                                  f"tokens, the target's has {target.vocab_size}", param=PARAM)
    try:
        own = load_tokenizer(model)
    except InvalidRequestError:  # no tokenizer of its own
        return
    if own.backend.get_vocab(with_added_tokens=True) != \
            target.tokenizer.backend.get_vocab(with_added_tokens=True):
        raise InvalidRequestError(f"{PARAM} {model!r} has a different tokenizer than the "
                                  "target (token -> id maps differ)", param=PARAM)


class _DraftState:
    """What the draft holds for one sequence (see the module docstring's diagram)."""

    __slots__ = ("table", "base", "tail", "used")

    def __init__(self) -> None:
        self.table: list[int] = []  # draft pool blocks
        self.base = 0  # token_ids[:base] computed by the draft
        self.tail: list[int] = []  # drafted tokens computed after base
        self.used = 0  # the proposer's clock when it last drafted (eviction order)


class DraftModelProposer(Proposer):
    """Greedy drafts from a draft model's runner (real, or a fake in tests). Owns the
    draft pool's free list and per-sequence draft state; called only from the engine
    loop. Mutates the draft runner's KV pool, never the target's or its sequences."""

    blind = True

    def __init__(self, config: SpeculativeConfig, runner: Any = None) -> None:
        if runner is None:
            raise InvalidRequestError(f"{PARAM} needs a loaded draft model", param=PARAM)
        self.runner = runner
        self.block_size: int = runner.block_size
        self.free: list[int] = list(range(runner.num_kv_blocks - 1, -1, -1))
        self.states: dict[Sequence, _DraftState] = {}
        self.cost = StepCost()  # draft forward seconds against its tokens
        self.clock = 0
        self.num_forwards = 0
        self.seconds = 0.0  # spent in draft forwards

    @classmethod
    def from_engine(cls, config: SpeculativeConfig, engine: EngineConfig | None,
                    runner: Any) -> Proposer:
        return cls(config, load_draft_runner(config, engine, runner))

    def calibrate(self, max_seqs: int) -> None:
        if hasattr(self.runner, "model"):  # a real model (fakes have no cost to measure)
            self.cost.calibrate(self.runner, SeqChunk, min(max_seqs, self.runner.max_model_len))

    def draft_seconds(self, wants: list[tuple[Sequence, int]]) -> float:
        """One forward per depth over the sequences drafting that deep (the catch-up
        counted as one token each)."""
        if not wants or not self.cost.points:
            return 0.0
        depths = [k for _, k in wants]
        return sum(self.cost.seconds(sum(1 for k in depths if k > j))
                   for j in range(max(depths)))

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_batch([(seq, k)])[0]

    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Catch up, then draft k tokens per sequence greedily; [] where the draft pool or
        the draft's context length has no room."""
        self.clock += 1
        batch = {seq for seq, _ in wants}
        ready: list[tuple[Sequence, int, _DraftState]] = []
        for seq, k in wants:
            st = self._synced(seq)
            k = min(k, self.runner.max_model_len - len(seq.token_ids) + 1)
            if k >= 1 and self._reserve(st, len(seq.token_ids) + k - 1, batch):
                st.used = self.clock
                ready.append((seq, k, st))
        drafts: dict[Sequence, list[int]] = {}
        if not ready:
            return [[] for _ in wants]
        chunks = [SeqChunk(seq.token_ids[st.base:], st.base, st.table, True)
                  for seq, _, st in ready]
        for (seq, _, st), token in zip(ready, self._greedy(chunks), strict=True):
            st.base = len(seq.token_ids)
            drafts[seq] = [token]
        for j in range(1, max(k for _, k, _ in ready)):
            live = [(seq, st) for seq, k, st in ready if k > j]
            chunks = [SeqChunk([drafts[seq][-1]], st.base + len(st.tail), st.table, True)
                      for seq, st in live]
            for (seq, st), token in zip(live, self._greedy(chunks), strict=True):
                st.tail.append(drafts[seq][-1])
                drafts[seq].append(token)
        return [drafts.get(seq, []) for seq, _ in wants]

    def _synced(self, seq: Sequence) -> _DraftState:
        """`seq`'s draft state, rolled back to the drafted tokens the target kept; the
        last token is always left to compute (its logits give the first draft)."""
        st = self.states.get(seq)
        if st is None:
            st = self.states[seq] = _DraftState()
        tokens, n = seq.token_ids, 0
        while n < len(st.tail) and st.base + n < len(tokens) and tokens[st.base + n] == st.tail[n]:
            n += 1
        st.base, st.tail = min(st.base + n, len(tokens) - 1), []
        return st

    def _reserve(self, st: _DraftState, num_tokens: int, keep: set[Sequence]) -> bool:
        """Blocks for `num_tokens` positions, evicting other sequences' state (least
        recently drafted first, never one in `keep`) if the pool is short."""
        need = blocks_needed(num_tokens, self.block_size) - len(st.table)
        if need > len(self.free):
            for seq in sorted((s for s in self.states if s not in keep),
                              key=lambda s: self.states[s].used):
                self.forget(seq)
                if need <= len(self.free):
                    break
        if need > len(self.free):
            return False
        for _ in range(need):
            st.table.append(self.free.pop())
        return True

    def _greedy(self, chunks: list[SeqChunk]) -> list[int]:
        """One draft forward (timed into the cost curve); each chunk's argmax token."""
        start = time.perf_counter()
        logits = self.runner.execute(chunks)
        tokens: list[int] = logits.argmax(dim=-1).tolist()
        seconds = time.perf_counter() - start
        self.cost.observe(sum(len(c.token_ids) for c in chunks), seconds)
        self.num_forwards += 1
        self.seconds += seconds
        return tokens

    def pause(self, seq: Sequence) -> None:
        self.forget(seq)

    def forget(self, seq: Sequence) -> None:
        st = self.states.pop(seq, None)
        if st is not None:
            self.free.extend(reversed(st.table))
