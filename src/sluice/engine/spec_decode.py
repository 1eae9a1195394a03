"""Speculative decoding: guess a few tokens per sequence, verify them in one forward.

    before schedule   token_ids [... t] + drafts [d1 d2 d3]     (ngram | suffix | draft_model)
    the step          chunk [t d1 d2 d3] at positions p..p+3: one forward, K/V written
                      at all four slots, logits for all four rows
    verify            row 0 is the distribution of p+1: d1 accepted? row 1 -> d2? ...
                      the first rejection ends it; the row after the last accepted draft
                      gives one more token (the correction, or a bonus): 1..k+1 tokens
    roll back         token_ids [... t d1 x], num_computed_tokens = p + 2 (t and d1's K/V
                      stay valid); blocks past the last token's are freed, rejected slots
                      in the kept block are overwritten before anything reads them

Drafts come from the server's method (`--speculative-config`) or, for a request that
brings one, from its predicted output (`PredictionProposer`: OpenAI's `prediction`, on
every engine). The drafts ride in `seq.token_ids` from `propose` until the forward, so
the scheduler plans them like any uncomputed tokens (budget, blocks, preemption) with
no code of its own; `fit` trims what the step did not schedule. Acceptance keeps outputs exactly those
of plain decoding: each position is sampled by the plain sampler, with the sequence
state plain decoding would have there (earlier tokens appended: penalties, min_tokens,
the per-position seed), and the draft is accepted iff the sample equals it. For a
point-mass draft (n-gram and suffix drafts are certain) that *is* rejection sampling:
the draft t is accepted with probability p(t), and on rejection the token is drawn from
p with t removed, renormalised; so each token is distributed as plain sampling's, and a
seeded request gets the very tokens it gets without speculation (greedy: the argmax).
The core appends the tokens one by one through its usual stop checks (EOS, stop ids,
max_tokens).

Draft model (`sluice.engine.spec_draft`): a smaller model with the target's vocabulary
proposes greedily (its argmax), so its draft is a point mass too and the same acceptance
rule is exact at any temperature. Unlike the text proposers its drafts cost forward
time and always fill the depth asked for, so the planner chooses first (depths from the
acceptance rates, the draft model's measured forward time in the cost) and the draft
model then runs only for the chosen sequences. Drafts with a sampled draft
distribution q and min(1, p/q) acceptance are not built.

Structured output: a constrained sequence drafts too. `propose` cuts its draft at the
first token the grammar refuses (and before a stop token): such a draft could never be
accepted. Before sampling, the core masks every verify row, row i in the grammar state
after drafts 1..i (`StructuredOutputManager.mask` walks the matcher through the draft
and rolls it back), so verification samples each position exactly as plain decoding
would, and the core's per-token `accept` advances the matcher over the kept tokens.

When to speculate (`SpecPlanner`): the forward's time grows slowly with its tokens only
while the step is bandwidth-bound. The planner keeps the measured step-time curve
(calibrated at start, then a moving average of real steps) and each sequence's measured
acceptance rate, and adds a sequence's drafts only while the expected tokens per second
of the step rise (counting the draft model's forwards, when there is one): at one
stream with predictable text it drafts deep; at a large batch of unpredictable text it
drafts nothing.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sluice.engine.block_manager import BlockManager, blocks_needed
from sluice.engine.config import EngineConfig, SpeculativeConfig
from sluice.engine.sampler import Sampler, SampleResult
from sluice.engine.sequence import Sequence, SequenceStatus
from sluice.engine.structured_output import draftable

if TYPE_CHECKING:
    from collections.abc import Callable

    from sluice.engine.scheduler import ScheduledChunk

PRIOR_ACCEPTANCE = 0.5  # a sequence's acceptance rate before it has drafted
PREDICTION_PRIOR = 0.8  # ... when it drafts from its own prediction (the client's guess)
PREDICTION_TOKENS = 16  # drafted at most per step from a prediction, with no
#                         --speculative-config (the planner picks less where it pays less)
MIN_POSITION_PROB = 0.15  # draft position j only while rate**j reaches this
ACCEPTANCE_DECAY = 0.8  # weight of a sequence's past drafts against its last one
MIN_GAIN = 1.03  # a draft must raise the step's expected tokens/s by this factor
EXPLORE_EVERY = 16  # a sequence too unlikely to draft still tries one token this often
EXACT_TOKENS = 64  # the step-time curve keeps a point per size up to this many tokens


# -- proposers ------------------------------------------------------------------------
class Proposer(ABC):
    """Drafts tokens for a sequence from text it has seen. `propose` may keep per-sequence
    state; `forget` drops it when the sequence finishes.

    A `blind` proposer (a draft model) fills every position it is asked for and costs
    forward time: the planner picks sequences and depths before it drafts (pricing them
    with `draft_seconds`), then `propose_batch` drafts for the chosen ones at once."""

    blind: bool = False

    @abstractmethod
    def __init__(self, config: SpeculativeConfig) -> None:
        """Built from the engine's speculative config."""

    @classmethod
    def from_engine(cls, config: SpeculativeConfig, engine: EngineConfig | None,
                    runner: Any) -> Proposer:
        """Built beside an engine (`runner` is the target's model runner)."""
        return cls(config)

    @abstractmethod
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens that may follow `seq.token_ids` (may be empty)."""

    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """`propose` for each (sequence, k)."""
        return [self.propose(seq, k) for seq, k in wants]

    def draft_seconds(self, wants: list[tuple[Sequence, int]]) -> float:
        """Expected seconds `propose_batch(wants)` takes (0: text lookups are free)."""
        return 0.0

    def calibrate(self, max_seqs: int) -> None:  # noqa: B027 - optional hook
        """Measure what `draft_seconds` needs (nothing for text proposers)."""

    def pause(self, seq: Sequence) -> None:  # noqa: B027 - optional hook
        """`seq` was preempted: drop what holds memory it will not need while waiting."""

    @abstractmethod
    def forget(self, seq: Sequence) -> None:
        """`seq` finished (its tokens may feed later drafts)."""


class _NgramIndex:
    __slots__ = ("last", "upto")

    def __init__(self) -> None:
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self.upto = 0  # n-grams ending at 1..upto are indexed


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's `ngram`): the longest suffix of `prompt_lookup_min..max`
    tokens that occurred before; propose the tokens that followed its latest occurrence.
    An incremental index per sequence (n-gram -> latest end), so a step costs O(max)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lo, self.hi = config.prompt_lookup_min, config.prompt_lookup_max
        self.index: dict[Sequence, _NgramIndex] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        idx = self.index.get(seq)
        if idx is None:
            idx = self.index[seq] = _NgramIndex()
        last, lo, hi = idx.last, self.lo, self.hi
        for end in range(idx.upto + 1, len(tokens)):  # not the current suffix itself
            for n in range(lo, min(hi, end) + 1):
                last[tuple(tokens[end - n:end])] = end
        idx.upto = max(idx.upto, len(tokens) - 1)
        for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
            found = last.get(tuple(tokens[-n:]))
            if found is not None:
                return tokens[found:found + k]
        return []

    def forget(self, seq: Sequence) -> None:
        self.index.pop(seq, None)


Counts = dict[int, dict[int, int]]  # context key -> next-token counts
# A context's key is a 64-bit FNV-1a hash of its tokens read back from its last one
# (`tokens[end - 1]`, then `end - 2`, ...): the keys of all of one position's contexts,
# 1..depth tokens, come one multiply each (with a tuple per length, a slice and a tuple
# each, the proposer took 2.5x as long). Two contexts could share a key; that only makes
# a draft worse, never an output (every draft is verified).
_KEY_SEED = 0xCBF29CE484222325  # FNV-1a's 64-bit offset basis and prime
_KEY_PRIME = 0x100000001B3
_KEY_MASK = (1 << 64) - 1


def count_next(table: Counts, tokens: list[int], end: int, depth: int, delta: int) -> None:
    """Add `delta` to the count of `tokens[end]` after each context of 1..depth tokens."""
    nxt, key = tokens[end], _KEY_SEED
    for token in reversed(tokens[max(0, end - depth):end]):
        key = ((key ^ token) * _KEY_PRIME) & _KEY_MASK
        row = table.get(key)
        if row is None:
            row = table[key] = {}
        count = row.get(nxt, 0) + delta
        if count > 0:
            row[nxt] = count
        else:
            row.pop(nxt, None)
            if not row:
                del table[key]


class SuffixProposer(Proposer):
    """Suffix decoding (Arctic's, vLLM's `suffix`): next-token counts after every context
    of up to `suffix_decoding_max_tree_depth` tokens, over the sequence itself (prompt
    and output) and over the outputs of the last `suffix_decoding_max_cached_requests`
    finished sequences (a suffix tree's paths, stored as context key -> counts). A draft
    follows the most frequent continuation of the longest matching context; its depth
    adapts: at most `max_spec_factor` x the match length, and only while the product of
    the continuation's frequencies stays above `min_token_prob`."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.local: dict[Sequence, tuple[Counts, list[int]]] = {}  # counts, [indexed upto]
        self.shared: Counts = {}
        self.cached: deque[tuple[list[int], int]] = deque()  # (tokens, first output index)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        table, upto = self.local.setdefault(seq, ({}, [1]))
        for end in range(upto[0], len(tokens)):
            count_next(table, tokens, end, self.depth, 1)
        upto[0] = max(upto[0], len(tokens))
        ctx = tokens[-self.depth:]
        match, mine, theirs = self._longest(table, ctx)
        limit = min(k, int(self.factor * match))
        out: list[int] = []
        prob = 1.0
        while len(out) < limit and match:
            found = dict(theirs or {})  # the counts after the longest known context
            for tok, c in (mine or {}).items():
                found[tok] = found.get(tok, 0) + c
            token = max(found, key=found.__getitem__)
            prob *= found[token] / sum(found.values())
            if prob < self.min_prob:
                break
            out.append(token)
            ctx = (ctx + [token])[-self.depth:]
            match, mine, theirs = self._longest(table, ctx)
        return out

    def _longest(self, table: Counts, ctx: list[int]
                 ) -> tuple[int, dict[int, int] | None, dict[int, int] | None]:
        """The longest suffix of `ctx` seen in this sequence or in the shared outputs,
        read back from its end while each longer one was seen: its length and the two
        tables' counts after it."""
        shared, key = self.shared, _KEY_SEED
        n, mine, theirs = 0, None, None
        for token in reversed(ctx):
            key = ((key ^ token) * _KEY_PRIME) & _KEY_MASK
            m, t = table.get(key), shared.get(key)
            if m is None and t is None:
                break
            n, mine, theirs = n + 1, m, t
        return n, mine, theirs

    def forget(self, seq: Sequence) -> None:
        self.local.pop(seq, None)
        if self.max_cached == 0 or seq.num_output_tokens == 0:
            return
        tokens = list(seq.token_ids)
        self._count(tokens, seq.num_prompt_tokens, 1)
        self.cached.append((tokens, seq.num_prompt_tokens))
        if len(self.cached) > self.max_cached:
            old, first = self.cached.popleft()
            self._count(old, first, -1)

    def _count(self, tokens: list[int], first: int, delta: int) -> None:
        for end in range(max(first, 1), len(tokens)):
            count_next(self.shared, tokens, end, self.depth, delta)

    def reset(self) -> None:
        """Forget every finished sequence's output (benchmarks/spec_decode.py, so a pass
        over the same prompts does not draft from the last pass's answers)."""
        self.shared.clear()
        self.cached.clear()


RESYNC_MIN, RESYNC_MAX = 4, 8  # the output's last tokens looked up to find its place again


class _Track:
    """Where a sequence's output stands in its prediction."""

    __slots__ = ("pos", "seen", "synced", "_index")

    def __init__(self) -> None:
        self.pos = 0  # the prediction's token the output should produce next
        self.seen = 0  # output tokens walked
        self.synced = True  # False: the output left the prediction, not found again yet
        self._index: dict[tuple[int, ...], list[int]] | None = None

    def index(self, prediction: list[int]) -> dict[tuple[int, ...], list[int]]:
        """n-gram (RESYNC_MIN..RESYNC_MAX tokens) -> the prediction indices right after
        each of its occurrences, ascending; built when the output first leaves it."""
        if self._index is None:
            self._index = {}
            for n in range(RESYNC_MIN, RESYNC_MAX + 1):
                for end in range(n, len(prediction) + 1):
                    self._index.setdefault(tuple(prediction[end - n:end]), []).append(end)
        return self._index


class PredictionProposer(Proposer):
    """OpenAI's predicted outputs (`SamplingParams.prediction`): a sequence with a
    prediction drafts the prediction's tokens from where its output stands in it. The
    output is walked token by token: while it repeats the prediction it stays in step;
    where it leaves it (an edit), it drafts by prompt lookup over its own text instead
    (`NgramProposer`) until its last 8..4 tokens are found in the prediction again (the
    first occurrence at or after the old place, else the first anywhere), and goes on
    after them. `from_prediction`: the sequences whose last draft was the prediction's.
    Sequences without a prediction draft with `inner` (the server's
    `--speculative-config` proposer), or not at all."""

    def __init__(self, config: SpeculativeConfig, inner: Proposer | None = None) -> None:
        self.inner = inner
        self.blind = inner.blind if inner is not None else False
        self.tracks: dict[Sequence, _Track] = {}
        self.lookup = NgramProposer(config)  # a predicted sequence's own text, off track
        self.from_prediction: set[Sequence] = set()

    def propose(self, seq: Sequence, k: int) -> list[int]:
        prediction = seq.params.prediction
        if prediction is None:
            return self.inner.propose(seq, k) if self.inner is not None else []
        track = self.tracks.get(seq)
        if track is None:
            track = self.tracks[seq] = _Track()
        tokens, start = seq.token_ids, seq.num_prompt_tokens
        for token in tokens[start + track.seen:]:  # the output tokens not walked yet
            if track.synced and track.pos < len(prediction) and prediction[track.pos] == token:
                track.pos += 1
            else:
                track.synced = False
        track.seen = len(tokens) - start
        if not track.synced:
            last = tokens[max(start, len(tokens) - RESYNC_MAX):]
            self._resync(track, last, track.index(prediction))
        draft = prediction[track.pos:track.pos + k] if track.synced else []
        if draft:
            self.from_prediction.add(seq)
            return draft
        self.from_prediction.discard(seq)
        return self.lookup.propose(seq, k)

    @staticmethod
    def _resync(track: _Track, last: list[int], index: dict[tuple[int, ...], list[int]]
                ) -> None:
        """Place `track` after the longest of the output's `last` tokens (at most
        RESYNC_MAX, at least RESYNC_MIN) found in the prediction."""
        for n in range(min(RESYNC_MAX, len(last)), RESYNC_MIN - 1, -1):
            found = index.get(tuple(last[-n:]))
            if found:
                after = bisect_left(found, track.pos)
                track.pos = found[after] if after < len(found) else found[0]
                track.synced = True
                return

    def propose_batch(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        theirs = [(seq, k) for seq, k in wants if seq.params.prediction is None]
        drafted = iter(self.inner.propose_batch(theirs) if self.inner is not None and theirs
                       else [[] for _ in theirs])
        return [next(drafted) if seq.params.prediction is None else self.propose(seq, k)
                for seq, k in wants]

    def draft_seconds(self, wants: list[tuple[Sequence, int]]) -> float:
        theirs = [(seq, k) for seq, k in wants if seq.params.prediction is None]
        return self.inner.draft_seconds(theirs) if self.inner is not None and theirs else 0.0

    def calibrate(self, max_seqs: int) -> None:
        if self.inner is not None:
            self.inner.calibrate(max_seqs)

    def pause(self, seq: Sequence) -> None:
        if self.inner is not None:
            self.inner.pause(seq)

    def forget(self, seq: Sequence) -> None:
        self.tracks.pop(seq, None)
        self.lookup.forget(seq)
        self.from_prediction.discard(seq)
        if self.inner is not None:
            self.inner.forget(seq)


def _draft_model() -> type[Proposer]:
    from sluice.engine.spec_draft import DraftModelProposer  # torch models: loaded on use

    return DraftModelProposer


PROPOSERS: dict[str, Callable[[], type[Proposer]]] = {
    "ngram": lambda: NgramProposer, "suffix": lambda: SuffixProposer,
    "draft_model": _draft_model}


# -- when and how deep ------------------------------------------------------------------
class StepCost:
    """Forward seconds against tokens in the step: points (mean tokens, mean seconds) per
    bucket, moving averages of real steps, linearly interpolated. Up to `EXACT_TOKENS`
    a bucket is one size: a step's time jumps where its rows start a new block of the
    kernels' (an AMX tile is 16 rows: 32 decodes took 23.4 ms and 33-40 rows 27-29 on an
    Intel Xeon with AMX, which quarter-octave buckets averaged into one point, so the
    planner priced 4-8 draft rows on 32 decodes at 1-2 ms and drafted at a loss); past
    it, quarter octaves.

    A point only calibrated (`observe` with weight 1: `calibrate`, or a test's set
    point) and not yet met by a real step follows the real steps' drift: the moving
    average of real over calibrated seconds in the buckets that have both. Without it a
    calibration taken while the host was slower than later (a shared VM moves by 30%
    from minute to minute) kept its verify sizes' times while real one-token steps
    pulled that size down, so every draft looked dear and none ran to be measured again
    (a whole `benchmarks/spec_decode.py` run on a Zen 4 drafted 3 times, the next run of
    the same code 304)."""

    def __init__(self) -> None:
        self.points: dict[int, list[float]] = {}  # bucket -> [tokens, seconds]
        self.calibrated: dict[int, float] = {}  # bucket -> seconds when calibrated
        self.real: set[int] = set()  # buckets real steps have met since
        self.drift = 1.0  # real over calibrated seconds, moving average

    def observe(self, tokens: int, seconds: float, weight: float = 0.1) -> None:
        """A step's time; weight 1 calibrates (sets) that size's point."""
        if tokens <= 0:
            return
        bucket = tokens if tokens <= EXACT_TOKENS else EXACT_TOKENS + round(math.log2(tokens) * 4)
        if weight >= 1.0:
            self.points[bucket] = [float(tokens), seconds]
            self.calibrated[bucket] = seconds
            self.real.discard(bucket)
            return
        if self.calibrated.get(bucket, 0.0) > 0.0:
            self.drift += weight * (seconds / self.calibrated[bucket] - self.drift)
        point = self.points.get(bucket)
        if point is None:
            self.points[bucket] = [float(tokens), seconds]
        else:
            if bucket not in self.real:  # from the calibrated time as it stands now
                point[1] *= self.drift
            point[0] += weight * (tokens - point[0])
            point[1] += weight * (seconds - point[1])
        self.real.add(bucket)

    def seconds(self, tokens: float) -> float:
        pts = sorted((p[0], p[1] if b in self.real else p[1] * self.drift)
                     for b, p in self.points.items())
        if not pts:
            return 1.0
        xs = [p[0] for p in pts]
        i = bisect_left(xs, tokens)
        if i == 0:
            return pts[0][1]
        if i == len(pts):  # past the largest point: proportional
            return pts[-1][1] * tokens / pts[-1][0]
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0) if x1 > x0 else y1

    def calibrate(self, runner: Any, chunk_cls: Any, max_tokens: int, block: int = 0) -> None:
        """Time forwards of 1.. `max_tokens` tokens shaped as verifies (one query and one
        logit row per token; the slots of `block` only: block 0 at start, as warm-up, or
        a free block taken for it later) to seed the curve: every size to 8, each side
        of the multiples of 16 to 64 (where the kernels' row blocks end), then growing
        by half."""
        bs, sizes = runner.block_size, [*range(1, 9), 12, 16, 17, 24, 32, 33, 40, 48, 49,
                                         56, 64, 65]
        while sizes[-1] * 3 // 2 <= max_tokens:
            sizes.append(sizes[-1] * 3 // 2)
        for n in (n for n in sizes if n <= max_tokens):
            best = float("inf")
            for _ in range(2):
                chunk = chunk_cls([0] * n, 0, [block] * blocks_needed(n, bs), True)
                chunk.num_logits = n  # a verify's shape: n decode queries, n logit rows
                start = time.perf_counter()
                runner.execute([chunk])
                best = min(best, time.perf_counter() - start)
            self.observe(n, best, weight=1.0)


@dataclass
class _Candidate:
    seq: Sequence
    size: int  # tokens to draft
    gain: float  # expected accepted tokens
    draft: list[int] | None = None  # None: a blind proposer drafts after choosing


def grammatical(seq: Sequence, draft: list[int]) -> list[int]:
    """`draft` up to the first token `seq`'s grammar refuses (and before a stop token):
    a refused draft could never be accepted, so verifying it wastes its rows. A reasoning
    model's thinking is not the grammar's: only draft tokens after its end tag are; and
    a thinking sequence with a `thinking_token_budget` drafts only short of it (the row
    where it is spent writes the end tag: `StructuredOutputManager.force`)."""
    room = seq.thinking.room if seq.thinking is not None else None
    if room is not None:
        draft = draft[:max(0, room - 1)]
    if seq.grammar is None:
        return draft
    answer = 0 if seq.thinking is None else seq.thinking.answer_from(seq, draft)
    if answer is None:
        return draft
    return draft[:answer + draftable(seq.grammar, draft[answer:])]


def expected_accepted(rate: float, size: int) -> float:
    """Expected accepted tokens of a `size`-token draft at acceptance `rate` per position."""
    return sum(rate ** j for j in range(1, size + 1))




class SpecPlanner:
    """Per-sequence acceptance rates and the step-time curve; picks the drafts that pay."""

    def __init__(self, adaptive: bool, disable_by_batch_size: int | None) -> None:
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.cost = StepCost()
        self.rates: dict[Sequence, list[float]] = {}  # seq -> [accepted, drafted] (decayed)
        self.prior = PRIOR_ACCEPTANCE  # across sequences, moving average
        self.idle: dict[Sequence, int] = {}  # seq -> decode steps since it last drafted

    def rate(self, seq: Sequence) -> float:
        acc, drafted = self.rates.get(seq, (0.0, 0.0))
        prior = PREDICTION_PRIOR if seq.params.prediction is not None else self.prior
        return (acc + 2 * prior) / (drafted + 2)

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verify's outcome. Trials: accepted ones, plus the rejected one if any. A
        prediction's drafts do not move the prior of the server's own proposer."""
        trials = accepted + (1 if accepted < drafted else 0)
        state = self.rates.setdefault(seq, [0.0, 0.0])
        state[0] = ACCEPTANCE_DECAY * state[0] + accepted
        state[1] = ACCEPTANCE_DECAY * state[1] + trials
        if trials and seq.params.prediction is None:
            self.prior += 0.02 * (accepted / trials - self.prior)

    def depth(self, seq: Sequence, k: int) -> int:
        """Positions whose chance of being reached (rate**j) is worth a row; at least one
        every EXPLORE_EVERY steps, so a rate that fell (a sequence's, or the prior every
        new sequence starts from) is measured again instead of staying off for good."""
        rate, j = self.rate(seq), 0
        while j < k and rate ** (j + 1) >= MIN_POSITION_PROB:
            j += 1
        idle = 0 if j else self.idle.get(seq, 0) + 1
        if idle >= EXPLORE_EVERY and k > 0:
            j, idle = 1, 0
        self.idle[seq] = idle
        return j

    def may_pay(self, step_tokens: int, num_decodes: int, k: int,
                draft_seconds: float = 0.0) -> bool:
        """Whether any draft could pay this step: `k` drafted tokens, nearly all accepted,
        drafting them costing `draft_seconds` (an optimistic bound; skips proposing at
        all in a large, compute-bound step)."""
        if self.disable_by_batch_size is not None and num_decodes > self.disable_by_batch_size:
            return False
        if not self.adaptive or num_decodes == 0:
            return num_decodes > 0
        out, tokens = max(num_decodes, 1), max(step_tokens, 1)
        best = (out + 0.9 * k) / (self.cost.seconds(tokens + k) + draft_seconds)
        return best >= out / self.cost.seconds(tokens) * MIN_GAIN

    def worth_drafting(self, wants: list[tuple[Sequence, int]], step_tokens: int,
                       num_decodes: int) -> bool:
        """Whether `choose` could take any draft of up to `room` tokens from these
        sequences this step. `choose` tries the draft with the best gain per token first
        and stops at the first that does not pay, so if no sequence's draft of any size
        1..room would pay alone, at that sequence's own acceptance rate, it takes none
        and the proposer need not run (a text proposer drafts for every sequence before
        `choose`: at 32 streams that was most of what speculation cost)."""
        if not self.adaptive:
            return bool(wants)
        out, tokens = float(max(num_decodes, 1)), float(max(step_tokens, 1))
        bar = out / self.cost.seconds(tokens) * MIN_GAIN
        tried: set[tuple[float, int]] = set()
        for seq, room in wants:
            rate = self.rate(seq)
            if (rate, room) in tried:
                continue
            tried.add((rate, room))
            for n in range(1, room + 1):
                if (out + expected_accepted(rate, n)) / self.cost.seconds(tokens + n) >= bar:
                    return True
        return False

    def choose(self, cands: list[_Candidate], step_tokens: int, num_decodes: int,
               draft_cost: Callable[[list[_Candidate]], float] | None = None
               ) -> list[_Candidate]:
        """The drafts to run: best expected gain per token first, each only while the
        step's expected tokens per second rise (every candidate when not adaptive).
        `draft_cost(chosen)`: seconds drafting them takes (a draft model's forwards)."""
        if self.disable_by_batch_size is not None and num_decodes > self.disable_by_batch_size:
            return []
        if not self.adaptive:
            return cands
        cands = sorted(cands, key=lambda c: c.gain / c.size, reverse=True)
        out_tokens, tokens = float(max(num_decodes, 1)), float(max(step_tokens, 1))
        rate = out_tokens / self.cost.seconds(tokens)
        chosen: list[_Candidate] = []
        for c in cands:
            extra = draft_cost(chosen + [c]) if draft_cost is not None else 0.0
            new = (out_tokens + c.gain) / (self.cost.seconds(tokens + c.size) + extra)
            if new < rate * MIN_GAIN:
                break
            chosen.append(c)
            out_tokens, tokens, rate = out_tokens + c.gain, tokens + c.size, new
        return chosen

    def forget(self, seq: Sequence) -> None:
        self.rates.pop(seq, None)
        self.idle.pop(seq, None)


# -- the component the core hooks in ------------------------------------------------------
class SpecDecoder:
    """Drafts, trims, verifies and rolls back; owns the spec-decode counters. Called only
    from the engine loop. Mutates sequences' `token_ids`, `num_computed_tokens` and block
    tables (through the block manager)."""

    def __init__(self, config: SpeculativeConfig, sampler: Sampler,
                 block_manager: BlockManager, max_model_len: int,
                 proposer: Proposer | None = None, predictions_only: bool = False) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        inner = proposer if proposer is not None or predictions_only \
            else PROPOSERS[config.method]()(config)
        self.drafter = PredictionProposer(config, inner)  # `proposer` inside it
        # no --speculative-config: only sequences with a prediction draft; the step-time
        # curve is measured when the first of them comes (`lazy_calibration`)
        self.predictions_only = predictions_only
        self.lazy_calibration: Callable[[], None] | None = None
        self.planner = SpecPlanner(config.adaptive, config.disable_by_batch_size)
        self.sampler = sampler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.pending: dict[Sequence, list[int]] = {}  # drafts appended, not yet scheduled
        self.known: set[Sequence] = set()  # sequences with proposer / planner state
        # steps of up to this many one-query rows run as the decode graph (None: no graph)
        self.graph_rows: int | None = None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    @property
    def proposer(self) -> Proposer | None:
        """The server's own proposer (`--speculative-config`'s method; None: predictions
        only), which drafts for the sequences without a prediction."""
        return self.drafter.inner

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        self.drafter.inner = proposer
        self.drafter.blind = proposer.blind if proposer is not None else False

    def calibrate(self, runner: Any, chunk_cls: Any, max_tokens: int, max_seqs: int,
                  block: int = 0) -> None:
        """Seed the step-time curve (`StepCost.calibrate`) and the proposer's own costs."""
        self.planner.cost.calibrate(runner, chunk_cls, max_tokens, block)
        self.drafter.calibrate(max_seqs)

    def observe_step(self, tokens: int, seconds: float) -> None:
        self.planner.cost.observe(tokens, seconds)

    # -- before and after scheduling --------------------------------------------------
    def propose(self, running: list[Sequence], budget: int) -> None:
        """Append the chosen drafts to running decodes' `token_ids` (`fit` trims them)."""
        self._forget_finished()
        if self.predictions_only:
            if not any(s.params.prediction is not None for s in running):
                return
            if self.lazy_calibration is not None:
                calibrate, self.lazy_calibration = self.lazy_calibration, None
                calibrate()
        decodes = [s for s in running if s.num_computed_tokens == len(s.token_ids) - 1]
        step_tokens = min(budget, sum(len(s.token_ids) - s.num_computed_tokens
                                      for s in running))
        if self.graph_rows is not None and step_tokens == len(decodes) <= self.graph_rows:
            # plain decoding's step runs as the decode graph: the verify stays there too,
            # so each row is computed as plain decoding computes it (past the graph's rows
            # the torch model's batched GEMM rounds differently) and the outputs stay
            # plain decoding's
            budget = min(budget, self.graph_rows)
        k = min(self.k, budget - step_tokens)  # a longer draft would never be scheduled
        if k < 1:
            return
        one = self.drafter.draft_seconds([(decodes[0], k)]) if decodes else 0.0
        if not self.planner.may_pay(step_tokens, len(decodes), k, one):
            return
        wants = []
        for seq in decodes:
            room = min(k, seq.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - len(seq.token_ids) - 1,
                       self.planner.depth(seq, k) if self.config.adaptive else k)
            if room >= 1:
                self.known.add(seq)
                wants.append((seq, room))
        if not self.planner.worth_drafting(wants, step_tokens, len(decodes)):
            return
        if self.drafter.blind:  # choose, then draft only for the chosen
            cands = [self._candidate(seq, self._blind_size(seq, room, step_tokens,
                                                           len(decodes)))
                     for seq, room in wants]
            chosen = self._room(self.planner.choose(cands, step_tokens, len(decodes),
                                                    self._draft_cost),
                                running, budget - step_tokens)
            drafts = [grammatical(c.seq, d) for c, d in zip(
                chosen, self.drafter.propose_batch([(c.seq, c.size) for c in chosen]),
                strict=True)]
        else:  # draft (cheap lookups), then choose among the drafts found
            found = [grammatical(seq, d[:room]) for (seq, room), d in
                     zip(wants, self.drafter.propose_batch(wants), strict=True)]
            cands = [self._candidate(seq, len(d), d)
                     for (seq, _), d in zip(wants, found, strict=True) if d]
            chosen = self._room(self.planner.choose(cands, step_tokens, len(decodes)),
                                running, budget - step_tokens)
            drafts = [c.draft or [] for c in chosen]
        for c, draft in zip(chosen, drafts, strict=True):
            if draft:
                c.seq.token_ids.extend(draft)
                self.pending[c.seq] = draft

    def _candidate(self, seq: Sequence, size: int, draft: list[int] | None = None
                   ) -> _Candidate:
        return _Candidate(seq, size, expected_accepted(self.planner.rate(seq), size), draft)

    def _blind_size(self, seq: Sequence, room: int, step_tokens: int, num_decodes: int) -> int:
        """A blind proposer's depth for `seq`: of 1..room, the one whose expected tokens
        per second (verify and drafting both timed) is best, `seq` drafting alone."""
        if not self.config.adaptive:
            return room
        out, rate, cost = max(num_decodes, 1), self.planner.rate(seq), self.planner.cost
        best, size = 0.0, room
        for n in range(1, room + 1):
            value = (out + expected_accepted(rate, n)) / (
                cost.seconds(step_tokens + n) + self.drafter.draft_seconds([(seq, n)]))
            if value > best:
                best, size = value, n
        return size

    def _draft_cost(self, cands: list[_Candidate]) -> float:
        return self.drafter.draft_seconds([(c.seq, c.size) for c in cands])

    def _room(self, chosen: list[_Candidate], running: list[Sequence],
              left: int) -> list[_Candidate]:
        """The chosen drafts that free blocks and the token budget cover: never preempt
        or crowd out a prompt for a guess."""
        free = self.block_manager.num_free_blocks - len(running)
        out = []
        for c in chosen:
            seq, bs = c.seq, self.block_manager.block_size
            extra = blocks_needed(len(seq.token_ids) + c.size, bs) - len(seq.block_table)
            if extra > free or c.size > left:
                continue
            free, left = free - max(extra, 0), left - c.size
            out.append(c)
        return out

    def fit(self, chunks: list[ScheduledChunk]) -> dict[Sequence, list[int]]:
        """Cut drafts to what the step scheduled; drop those of sequences it did not
        (preempted, out of budget). Returns the drafts to verify, by sequence."""
        scheduled: dict[Sequence, list[int]] = {}
        if not self.pending:
            return scheduled
        for chunk in chunks:
            draft = self.pending.pop(chunk.seq, None)
            if draft is None:
                continue
            keep = chunk.num_tokens - 1  # the chunk starts at the last real token
            if keep < len(draft):
                del chunk.seq.token_ids[len(chunk.seq.token_ids) - len(draft) + keep:]
                draft, chunk.need_logits = draft[:keep], True
            if draft:
                scheduled[chunk.seq] = draft
        for seq, draft in self.pending.items():
            del seq.token_ids[-len(draft):]
        self.pending = {}
        return scheduled

    # -- after the forward --------------------------------------------------------------
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               drafts: dict[Sequence, list[int]], plain: Any) -> list[list[SampleResult]]:
        """Tokens for every sampled sequence: `plain(rows, seqs)` for those without
        drafts (one row each), verification for the others (len(draft) + 1 rows each)."""
        if not drafts:  # nothing drafted this step: the plain path, no row copies
            return [[r] for r in plain(logits, seqs)]
        starts, row = [], 0
        for seq in seqs:
            starts.append(row)
            row += len(drafts.get(seq, ())) + 1
        out: list[list[SampleResult]] = [[] for _ in seqs]
        plain_ix = [i for i, s in enumerate(seqs) if s not in drafts]
        if plain_ix:
            rows = logits[[starts[i] for i in plain_ix]]
            for i, res in zip(plain_ix, plain(rows, [seqs[i] for i in plain_ix]), strict=True):
                out[i] = [res]
        for i, seq in enumerate(seqs):
            draft = drafts.get(seq)
            if draft is not None:
                out[i] = self.verify(seq, logits[starts[i]:starts[i] + len(draft) + 1], draft)
        return out

    def verify(self, seq: Sequence, logits: torch.Tensor,
               draft: list[int]) -> list[SampleResult]:
        """Strip the draft from `seq.token_ids`; the tokens plain decoding would emit,
        1..len(draft)+1 of them. Counts the outcome."""
        del seq.token_ids[-len(draft):]
        if self.sampler.is_plain_greedy(seq):
            out = []
            for i, token in enumerate(logits.argmax(dim=-1).tolist()):
                out.append(SampleResult(token))
                if i == len(draft) or token != draft[i]:
                    break
        else:
            out = self._verify_sampled(seq, logits.float().cpu(), draft)
        self._count(seq, len(draft), len(out) - 1)
        return out

    def _verify_sampled(self, seq: Sequence, logits: torch.Tensor,
                        draft: list[int]) -> list[SampleResult]:
        base = len(seq.token_ids)
        out: list[SampleResult] = []
        try:  # each position sees the state plain decoding would: earlier tokens appended
            for i in range(len(draft) + 1):
                res = self.sampler(logits[i:i + 1], [seq])[0]
                out.append(res)
                if i == len(draft) or res.token_id != draft[i]:
                    break
                seq.token_ids.append(res.token_id)
        finally:
            del seq.token_ids[base:]
        return out

    def _count(self, seq: Sequence, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        self.planner.record(seq, drafted, accepted)
        if seq in self.drafter.from_prediction:
            seq.num_accepted_prediction_tokens += accepted
            seq.num_rejected_prediction_tokens += drafted - accepted

    def commit(self, seq: Sequence) -> None:
        """After the verified tokens were appended (and `seq` did not finish): every token
        but the last has valid K/V; cache blocks that filled, free blocks past the end."""
        seq.num_computed_tokens = len(seq.token_ids) - 1
        bm = self.block_manager
        if seq.num_computed_tokens // bm.block_size > len(seq.block_hashes):
            bm.cache_full_blocks(seq)
        bm.trim(seq)

    def _forget_finished(self) -> None:
        """Finished sequences: forget them; preempted ones: let the proposer free memory."""
        done = [s for s in self.known if s.status is not SequenceStatus.RUNNING]
        for seq in done:
            if seq.is_finished:
                self.known.discard(seq)
                self.drafter.forget(seq)
                self.planner.forget(seq)
            else:
                self.drafter.pause(seq)

    def stats(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_pos": list(self.accepted_per_pos)}
