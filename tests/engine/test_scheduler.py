"""Scheduler driven with plain sequences (no model): chunking, budget, priority, preemption."""

from __future__ import annotations

import random
from collections import Counter

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import SchedulerConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledChunk, Scheduler
from sluice.engine.sequence import Sequence, SequenceStatus
from sluice.protocol.kv_events import BlockRemoved

BS = 4


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8,
                   policy: str = "priority") -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             scheduling_policy=policy)
    return Scheduler(config, BlockManager(num_blocks, BS))


def make_seq(seq_id: int, num_prompt: int, max_tokens: int = 4, priority: int = 0,
             arrival: float | None = None, base: int = 0) -> Sequence:
    tokens = [base + seq_id * 100 + i for i in range(num_prompt)]
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, num_prompt, SamplingParams(), max_tokens,
                    priority, float(seq_id if arrival is None else arrival))


def step(sched: Scheduler) -> list[ScheduledChunk]:
    """One engine step with a fake model: each chunk that reaches the end samples a token."""
    chunks = sched.schedule()
    sched.update_from_output(chunks)
    for chunk in chunks:
        seq = chunk.seq
        if chunk.need_logits:
            seq.token_ids.append(7000 + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.max_tokens:
                sched.finish(seq)
    return chunks


def shape(chunks: list[ScheduledChunk]) -> list[tuple[int, int, int, bool]]:
    return [(c.seq.seq_id, c.start_pos, c.num_tokens, c.need_logits) for c in chunks]


def test_chunked_prefill_splits_a_long_prompt_then_decodes() -> None:
    sched = make_scheduler(budget=8)
    sched.add(make_seq(1, 20, max_tokens=2))
    assert shape(step(sched)) == [(1, 0, 8, False)]
    assert shape(step(sched)) == [(1, 8, 8, False)]
    assert shape(step(sched)) == [(1, 16, 4, True)]
    assert shape(step(sched)) == [(1, 20, 1, True)]
    assert not sched.has_unfinished()


def test_decodes_go_first_and_share_the_step_with_a_prefill_chunk() -> None:
    sched = make_scheduler(budget=8)
    sched.add(make_seq(1, 4, max_tokens=8))
    step(sched)
    sched.add(make_seq(2, 20))
    assert shape(step(sched)) == [(1, 4, 1, True), (2, 0, 7, False)]
    assert shape(step(sched)) == [(1, 5, 1, True), (2, 7, 7, False)]


def test_running_partial_prefill_is_scheduled_after_decodes() -> None:
    sched = make_scheduler(budget=6)
    sched.add(make_seq(2, 2, max_tokens=8, priority=1))
    step(sched)
    sched.add(make_seq(1, 20, priority=0))  # better priority, but still prefilling
    assert shape(step(sched)) == [(2, 2, 1, True), (1, 0, 5, False)]
    assert shape(step(sched)) == [(2, 3, 1, True), (1, 5, 5, False)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in (1, 2, 3):
        sched.add(make_seq(i, 3))
    assert [c.seq.seq_id for c in step(sched)] == [1, 2]
    assert [s.seq_id for s in sched.waiting] == [3]


def test_priority_orders_waiting_and_fcfs_ignores_it() -> None:
    for policy, expected in (("priority", [2, 3, 1]), ("fcfs", [1, 2, 3])):
        sched = make_scheduler(max_seqs=1, policy=policy)
        sched.add(make_seq(1, 3, priority=5))
        sched.add(make_seq(2, 3, priority=0))
        sched.add(make_seq(3, 3, priority=0))
        assert [s.seq_id for s in sched.waiting] == expected


def test_out_of_blocks_preempts_the_latest_arrival_and_evicts_its_tail_first() -> None:
    sched = make_scheduler(num_blocks=4)
    bm = sched.block_manager
    a, b = make_seq(1, 7, max_tokens=10), make_seq(2, 7, max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    step(sched)  # both compute position 7: second blocks full and cached
    b_hashes = list(b.block_hashes)
    bm.drain_events()
    chunks = step(sched)  # a needs a third block: b (later arrival) is preempted
    assert shape(chunks) == [(1, 8, 1, True)]
    assert b.status is SequenceStatus.WAITING and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_tokens == 9
    assert a.block_table == [0, 1, 3]  # b's blocks freed last-first: 3 evicted before 2
    assert bm.drain_events() == [BlockRemoved([b_hashes[1]])]
    assert list(bm.free_ids) == [2]
    assert sched.num_preemptions == 1
    assert bm.lookup(b) == [2]  # its first block is still cached: cheap recompute


def test_the_worst_sequence_preempts_itself_when_it_needs_a_block() -> None:
    sched = make_scheduler(num_blocks=3)
    a, b = make_seq(1, 5, max_tokens=3), make_seq(2, 4, max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    chunks = step(sched)  # b's decode at position 4 needs a second block
    assert shape(chunks) == [(1, 5, 1, True)]
    assert b.status is SequenceStatus.WAITING and sched.num_preemptions == 1
    assert a.block_table == [0, 1]


def test_higher_priority_arrival_preempts_a_lower_priority_runner() -> None:
    sched = make_scheduler(num_blocks=2)
    low = make_seq(1, 7, max_tokens=1, priority=5)
    low.max_tokens = 2
    sched.add(low)
    step(sched)
    assert low.block_table == [0, 1]
    high = make_seq(2, 3, priority=0)
    sched.add(high)
    chunks = step(sched)
    assert shape(chunks) == [(2, 0, 3, True)]  # low's decode was unscheduled
    assert low.status is SequenceStatus.WAITING
    later = make_seq(3, 3, priority=5)
    sched.add(later)
    assert [s.seq_id for s in sched.waiting] == [1, 3]  # preempted ahead of later arrivals


def test_equal_priority_arrival_waits_instead_of_preempting() -> None:
    sched = make_scheduler(num_blocks=2)
    first = make_seq(1, 7, max_tokens=2)
    sched.add(first)
    step(sched)
    sched.add(make_seq(2, 3))
    assert shape(step(sched)) == [(1, 7, 1, True)]
    assert sched.num_preemptions == 0


def test_tiny_pool_workload_finishes_without_deadlock() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=6, budget=8, max_seqs=4)
    seqs = [make_seq(i, rng.randint(3, 14), max_tokens=6, priority=rng.randint(0, 2))
            for i in range(1, 13)]
    for seq in seqs:
        sched.add(seq)
    for _ in range(1000):
        if not sched.has_unfinished():
            break
        chunks = step(sched)
        assert sum(c.num_tokens for c in chunks) <= 8
        live = [s for s in sched.running]
        refs = Counter(b for s in live for b in s.block_table)
        for block_id, count in refs.items():
            assert sched.block_manager.blocks[block_id].ref_count == count
    assert not sched.has_unfinished()
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert sched.block_manager.num_free_blocks == 6
    assert sched.num_preemptions > 0


def _with_prompt(seq_id: int, tokens: list[int], arrival: float) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), len(tokens), SamplingParams(), 2,
                    0, arrival)


def test_a_prefix_being_computed_is_waited_for_not_computed_twice() -> None:
    sched = make_scheduler(budget=64)
    shared = list(range(500, 512))  # three full blocks
    sched.add(_with_prompt(1, shared + [1, 2], 1.0))
    sched.add(_with_prompt(2, shared + [3, 4], 2.0))  # same prefix, arrives with it
    sched.add(make_seq(3, 6, arrival=3.0))  # unrelated: may go ahead of the deferred one
    assert shape(step(sched)) == [(1, 0, 14, True), (3, 0, 6, True)]
    # next step: seq 2 hits the three cached blocks and computes only its own 2 tokens
    assert shape(step(sched)) == [(1, 14, 1, True), (3, 6, 1, True), (2, 12, 2, True)]
    assert sched.block_manager.prefix_hits == 12


def test_a_partly_computed_prefix_is_waited_for_block_by_block() -> None:
    sched = make_scheduler(budget=8)  # seq 1's 14-token prompt takes two steps
    shared = list(range(500, 512))
    sched.add(_with_prompt(1, shared + [1, 2], 1.0))
    assert shape(step(sched)) == [(1, 0, 8, False)]
    sched.add(_with_prompt(2, shared + [3, 4], 2.0))
    # blocks 0-1 are cached, block 2 is still being computed by seq 1: wait for it
    assert shape(step(sched)) == [(1, 8, 6, True)]
    assert shape(step(sched)) == [(1, 14, 1, True), (2, 12, 2, True)]


def test_without_prefix_caching_nothing_waits() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(64, BS, enable_prefix_caching=False))
    shared = list(range(500, 512))
    sched.add(_with_prompt(1, shared + [1, 2], 1.0))
    sched.add(_with_prompt(2, shared + [3, 4], 2.0))
    assert shape(step(sched)) == [(1, 0, 14, True), (2, 0, 14, True)]


def test_queue_order_is_the_sequences_sort_key_under_both_policies() -> None:
    """The scheduler sorts with a C-level key; it must be `Sequence.sort_key`'s order."""
    rng = random.Random(3)
    for policy in ("priority", "fcfs"):
        sched = make_scheduler(num_blocks=4, budget=4, max_seqs=1, policy=policy)
        seqs = [make_seq(i, 8, priority=rng.randint(-2, 2), arrival=float(rng.randint(0, 5)))
                for i in range(1, 40)]
        for seq in seqs:
            sched.add(seq)
        use_priority = policy == "priority"
        assert sched.waiting == sorted(seqs, key=lambda s: s.sort_key(use_priority))
