"""Iteration-level scheduling: who computes how many tokens this step.

No prefill or decode phase (vLLM v1): every unfinished sequence wants to catch its
`num_computed_tokens` up to `num_tokens`. Each step has a token budget
(`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`):

1. Running sequences first, decodes (one token behind) before unfinished prompts, each
   in priority order; a long prompt takes what budget is left (chunked prefill).
   When the KV pool is out of blocks, the running sequence with the worst
   (priority, arrival) is preempted: its blocks are freed (its full blocks stay in the
   prefix cache) and it waits to be recomputed. If that is the sequence asking, it
   preempts itself.
2. Then, if nothing was preempted, waiting sequences in (priority, arrival) order: a
   prefix-cache lookup, then as much of the prompt as the budget allows. Under the
   "priority" policy a waiting sequence may preempt running ones of strictly worse
   priority to get blocks or a slot. A preempted sequence keeps its arrival time, so it
   goes back ahead of later arrivals of its priority.
   A waiting sequence whose next uncached block a running sequence is still computing
   (same tokens up to and including that block) waits: next step it hits the cache
   instead of computing the same prefix again (as SGLang does). Later arrivals may go
   ahead of it meanwhile. So does one whose next blocks an offload tier (disk, shared
   store) is fetching (`BlockManager.load_pending`; `sluice.engine.kv_offload`).
   Multi-LoRA: at most `max_loras` distinct adapters among running sequences (the
   runner's slots); a waiting sequence whose adapter would be one more waits, and
   later ones (base, or of a running adapter) may go ahead of it.

"fcfs" ignores priority values (arrival order only).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from operator import attrgetter

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import SchedulerConfig
from sluice.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq` starting at `start_pos` run this step; `need_logits`
    when the chunk reaches the sequence's last token (a token is sampled after it).
    Plain data, not changed after `schedule` returns it (not frozen: a frozen dataclass
    costs ~4x to construct, and there is one per sequence per step)."""

    seq: Sequence
    start_pos: int
    num_tokens: int
    need_logits: bool


class _StepPlan:
    __slots__ = ("budget", "scheduled", "preempted")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        # seq -> its chunk, built when it is scheduled (a preempted one is popped again)
        self.scheduled: dict[Sequence, ScheduledChunk] = {}
        self.preempted: set[Sequence] = set()


class Scheduler:
    """Owns the waiting and running lists; mutates sequences and the block manager.
    Called only from the engine loop (not thread-safe)."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 max_loras: int = 0) -> None:
        self.config = config
        self.max_loras = max_loras  # distinct adapters among running sequences (0: no LoRA)
        self.block_manager = block_manager
        self.use_priority = config.scheduling_policy == "priority"
        # `Sequence.sort_key` as a C-level key (the same order; sorted on every step).
        self._sort_key = (attrgetter("priority", "arrival_time", "seq_id") if self.use_priority
                          else attrgetter("arrival_time", "seq_id"))
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key at each step's start
        self._running_sorted = True  # nothing appended since the last sort (keys never change)
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._sort_key)

    def finish(self, seq: Sequence) -> None:
        """Remove `seq` wherever it is and free its blocks at once (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        """Plan this step: allocate blocks, advance prefix hits; returns the chunks."""
        plan = _StepPlan(self.config.max_num_batched_tokens)
        if self.running:
            self._schedule_running(plan)
        if self.waiting and not plan.preempted:
            self._schedule_waiting(plan)
        return list(plan.scheduled.values())

    def _schedule_running(self, plan: _StepPlan) -> None:
        # Once per engine step: the sequence properties (num_uncomputed_tokens) and the
        # common case of _make_room (room already there) are spelled out. Decodes are
        # scheduled in the pass that finds them (most steps have nothing else); the
        # unfinished prompts after them, in order.
        running = self.running
        if not self._running_sorted:  # (removals keep the order)
            running.sort(key=self._sort_key)
            self._running_sorted = True
        bm, scheduled = self.block_manager, plan.scheduled
        bs, free, running_status = bm.block_size, bm.free_ids, SequenceStatus.RUNNING
        prefills: list[Sequence] = []
        for seq in tuple(running):  # (a preemption removes from `running`)
            computed = seq.num_computed_tokens
            if len(seq.token_ids) - computed != 1:
                prefills.append(seq)  # (or nothing left to compute: skipped there)
                continue
            if plan.budget == 0:
                return
            if seq.status is not running_status:
                continue  # preempted earlier in this step
            # bm.can_allocate / bm.allocate spelled out: a running sequence has blocks, so
            # allocate only appends fresh ones, and most decodes need none
            fresh = (computed + bs) // bs - len(seq.block_table)
            if fresh > 0:
                if fresh > len(free) and not self._make_room(seq, 1, plan):
                    continue  # `seq` was the worst and got preempted
                bm.allocate(seq, 1)
            scheduled[seq] = ScheduledChunk(seq, computed, 1, True)
            plan.budget -= 1
        for seq in prefills:
            budget = plan.budget
            if budget == 0:
                return
            if seq.status is not running_status:
                continue  # preempted earlier in this step
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n < 1:
                continue
            if n > budget:  # min(), without the call
                n = budget
            fresh = (computed + n + bs - 1) // bs - len(seq.block_table)
            if fresh > 0:
                if fresh > len(free) and not self._make_room(seq, n, plan):
                    continue
                bm.allocate(seq, n)
            scheduled[seq] = ScheduledChunk(seq, computed, n, computed + n == len(seq.token_ids))
            plan.budget -= n

    def _make_room(self, seq: Sequence, n: int, plan: _StepPlan) -> bool:
        """Preempt worst-first until `seq` can get blocks for `n` tokens; False if `seq`
        itself was the worst and got preempted."""
        while not self.block_manager.can_allocate(seq, n):
            victim = max(self.running, key=self._sort_key)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        deferred: list[Sequence] = []
        try:
            self._admit_waiting(plan, deferred)
        finally:
            for seq in deferred:
                bisect.insort(self.waiting, seq, key=self._sort_key)

    def _admit_waiting(self, plan: _StepPlan, deferred: list[Sequence]) -> None:
        bm = self.block_manager
        adapters = {s.cache_salt for s in self.running if s.lora is not None}
        while self.waiting and plan.budget > 0:
            seq = self.waiting[0]
            if seq in plan.preempted:
                return
            if seq.lora is not None and seq.cache_salt not in adapters \
                    and len(adapters) >= self.max_loras:
                deferred.append(self.waiting.pop(0))  # every LoRA slot is in use: wait
                continue
            if len(self.running) >= self.config.max_num_seqs and not self._evict_for(seq, plan):
                return
            hits = bm.lookup(seq)
            if bm.load_pending or self._next_block_in_flight(seq, len(hits)):
                deferred.append(self.waiting.pop(0))
                continue
            remaining = seq.num_tokens - len(hits) * bm.block_size
            n = min(remaining, plan.budget)
            if n < remaining and not self.config.enable_chunked_prefill and plan.scheduled:
                return
            n = remaining if not self.config.enable_chunked_prefill else n
            while not bm.can_allocate(seq, n, hits):
                if not self._evict_for(seq, plan):
                    return
            self.waiting.pop(0)
            if seq.lora is not None:
                adapters.add(seq.cache_salt)
            bm.allocate(seq, n, hits)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._running_sorted = False
            start = seq.num_computed_tokens  # past the hits
            plan.scheduled[seq] = ScheduledChunk(seq, start, n, start + n == len(seq.token_ids))
            plan.budget -= n

    def _next_block_in_flight(self, seq: Sequence, num_hit_blocks: int) -> bool:
        """Whether a running sequence is computing `seq`'s first uncached block: it has the
        same tokens up to the end of that block and has not computed them all yet."""
        if not self.block_manager.enable_prefix_caching or seq.computes_whole_prompt:
            return False
        end = (num_hit_blocks + 1) * self.block_manager.block_size
        if end >= seq.num_tokens:  # no full block left to share (the last token is computed)
            return False
        prefix = seq.token_ids[:end]
        return any(other.num_computed_tokens < end <= other.num_tokens
                   and other.cache_salt == seq.cache_salt
                   and other.token_ids[:end] == prefix for other in self.running)

    def _evict_for(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Priority policy: preempt the worst running sequence if its priority is strictly
        worse than waiting `seq`'s. Returns whether one was preempted."""
        if not self.use_priority or not self.running:
            return False
        victim = max(self.running, key=self._sort_key)
        if victim.priority <= seq.priority:
            return False
        self._preempt(victim, plan)
        return True

    def _preempt(self, seq: Sequence, plan: _StepPlan) -> None:
        self.running.remove(seq)
        chunk = plan.scheduled.pop(seq, None)
        if chunk is not None:
            plan.budget += chunk.num_tokens
        plan.preempted.add(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def update_from_output(self, chunks: list[ScheduledChunk]) -> None:
        """After the model ran: the chunks' tokens are in the cache; cache full blocks."""
        bm = self.block_manager
        bs = bm.block_size
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens += chunk.num_tokens
            if seq.num_computed_tokens // bs > len(seq.block_hashes):  # a block became full
                bm.cache_full_blocks(seq)
