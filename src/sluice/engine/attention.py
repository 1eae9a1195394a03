"""Paged attention in plain PyTorch: write K/V at slots, read them back through block tables.

Every layer owns a pool of fixed-size blocks; a sequence's tokens live in the blocks its
block table lists, in order:

    block_table = [7, 2, 9]          block_size = 4
    position    0 1 2 3 | 4 5 6 7 | 8 9 ..
    block          7    |    2    |   9
    slot = block_table[pos // block_size] * block_size + pos % block_size
         = 7*4+1 = 29 for pos 1;  2*4+2 = 10 for pos 6

K pool `[num_blocks, block_size, num_kv_heads, head_dim]` viewed flat as
`[num_slots, num_kv_heads, head_dim]`: new tokens are written with one `index_copy_` at
their slots; a sequence's context is read with one `index_select` of whole blocks.

A step's sequences fall into at most two *groups* (decode: one query each; prefill
chunks: many). Each group is one `scaled_dot_product_attention` call: decodes use
torch's own GQA (`enable_gqa`); prefill chunks run over `[batch, kv_heads,
group*q_len, ctx]`, with the query heads that share a KV head folded into the query
axis (GQA without repeating K/V). Both use an additive mask (0 / -inf, in the model
dtype, so no layer converts a boolean one) for causality and padding.
`AttentionMetadata` (slots, block tables, masks) is built once per step and reused by
every layer, so nothing inside a layer loops over sequences in Python.

On CPU (float32, bfloat16), decodes skip the gather: `sluice.engine.native`'s kernel
reads K and V rows straight from the pool through the block tables (same results; the
gather copied every sequence's context once per layer). Prefill chunks too, where the
native kernels are built (`StepLayout.native_prefill`): each chunk's rows against its
own context, causal, without padding or a mask (`paged_prefill_attention`; SDPA over the
padded, masked batch computed every row against every column).

Gemma's layers differ per layer, not per step: a sliding-window layer sees only the last
`window` tokens of each context, and Gemma 2 caps its scores with a tanh. Such a layer
takes `AttentionMetadata.masked`, the step's groups with their masks spelled out (built
once a step for all such layers): the padded SDPA path, or the scores computed out where
they are capped (`_sdpa`). A group whose contexts all fit in the window (and whose scores
are not capped) is unchanged, and so are the native kernels' groups: the decode kernel
reads each row's last `window` rows alone, the prefill kernel gives the older keys no
weight, and both cap the scores themselves.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from sluice.engine.native import DecodeKernel, PrefillKernel


@dataclass
class KVCache:
    """One layer's K and V pools, `[num_blocks, block_size, num_kv_heads, head_dim]` each."""

    k: Tensor
    v: Tensor

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])

    def write(self, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store new tokens' `k`, `v` `[T, kv_heads, head_dim]` at `slots` `[T]` (mutates)."""
        kv_heads, head_dim = k.shape[1], k.shape[2]
        self.k.view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
        self.v.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)

    def gather(self, block_tables: Tensor) -> tuple[Tensor, Tensor]:
        """K, V of whole blocks: block_tables `[B, n]` -> `[B, kv_heads, n*block_size, head_dim]`."""
        b, n = block_tables.shape
        flat = block_tables.reshape(-1)
        shape = (b, n * self.block_size, self.k.shape[2], self.k.shape[3])
        k = self.k.index_select(0, flat).view(shape).transpose(1, 2)
        v = self.v.index_select(0, flat).view(shape).transpose(1, 2)
        return k, v


@dataclass
class AttentionGroup:
    """Sequences that share one SDPA call: queries padded to `[batch, q_len]`.

    The group's tokens are the contiguous slice `[start, end)` of the step's flat tokens.
    `scatter` maps them into the padded `batch*q_len` rows (None when already dense:
    decode, or a single chunk). `fresh` marks a single sequence starting at position 0,
    whose context is exactly its new tokens (no gather, plain causal attention).
    """

    start: int
    end: int
    batch: int
    q_len: int
    block_tables: Tensor  # [batch, n_blocks] int64
    mask: Tensor | None  # [batch, 1, gqa*q_len, n_blocks*block_size]: 0 attend, -inf not
    scatter: Tensor | None = None
    fresh: bool = False
    context_lens: Tensor | None = None  # [batch] int64: tokens each query attends to
    # prefill chunks for the native kernel: chunk i is the group's rows q_starts[i] ..
    # q_starts[i + 1], its last row attends to context_lens[i] tokens (no mask, no padding)
    q_starts: Tensor | None = None
    # each sequence's new tokens and the position of its first: what a sliding window's
    # variant of the group is built from (`AttentionMetadata.masked`)
    q_lens: tuple[int, ...] = ()
    start_positions: tuple[int, ...] = ()

    @property
    def longest_context(self) -> int:
        return max(s + n for s, n in zip(self.start_positions, self.q_lens, strict=True))


@dataclass(frozen=True)
class StepLayout:
    """What metadata building needs to know about the pool and the model."""

    block_size: int
    gqa: int  # query heads per KV head
    device: torch.device
    dtype: torch.dtype
    native_prefill: bool = False  # prefill groups for `paged_prefill_attention`
    # every query sees its whole sequence (EmbeddingGemma), a window |q - k| < window:
    # each group's mask spelled out (the plain path and the native kernels are causal)
    bidirectional: bool = False


@dataclass
class AttentionMetadata:
    slots: Tensor  # [T] int64, where each new token's K/V goes
    groups: list[AttentionGroup]
    decode_kernel: DecodeKernel | None = None  # native decode attention, if in use
    prefill_kernel: PrefillKernel | None = None  # native prefill attention, if in use
    layout: StepLayout | None = None  # what the groups were built for (`masked` needs it)
    _masked: dict[tuple[int | None, bool], list[AttentionGroup]] = field(default_factory=dict)

    def masked(self, window: int | None, every: bool = False) -> list[AttentionGroup]:
        """The groups as a sliding-window layer sees them (each query attends to the
        `window` tokens ending at its own, Gemma's local layers): a group whose every
        context fits the window unchanged, and so is one the native kernels take (they
        apply the window themselves); the others with a mask that also hides the older
        keys. `every`: each group but the native kernels' with its mask spelled out
        (Gemma 2's capped scores have no causal flag in SDPA). Built once a step for all
        such layers."""
        groups = self._masked.get((window, every))
        if groups is None:
            assert self.layout is not None, "metadata built without its layout"
            groups = [g if self._native(g) or (not every and (
                          window is None or g.longest_context <= window))
                      else _masked_group(g, window, self.layout) for g in self.groups]
            self._masked[(window, every)] = groups
        return groups

    def _native(self, g: AttentionGroup) -> bool:
        """A group the native kernels take (they apply a sliding window and a cap on the
        scores themselves)."""
        if g.q_starts is not None:
            return True
        return self.decode_kernel is not None and g.q_len == 1 and g.context_lens is not None


def paged_attention(q: Tensor, k: Tensor, v: Tensor, cache: KVCache,
                    meta: AttentionMetadata, window: int | None = None,
                    softcap: float | None = None) -> Tensor:
    """q `[T, heads, d]`, k/v `[T, kv_heads, d]` of the new tokens -> output `[T, heads*d]`.

    Writes k/v into `cache` first, so each token also attends to itself and to the
    tokens before it in the same step. `window`: a sliding-window layer's, each query
    sees only the `window` tokens ending at its own (the older ones stay in the cache).
    `softcap`: Gemma 2's scores, `softcap * tanh(scores / softcap)` before the softmax.
    """
    cache.write(meta.slots, k, v)
    t, heads, d = q.shape
    bidirectional = meta.layout is not None and meta.layout.bidirectional
    groups = (meta.groups if window is None and softcap is None and not bidirectional
              else meta.masked(window, every=softcap is not None or bidirectional))
    if len(groups) == 1:
        return _group_attention(q, k, v, cache, groups[0], meta, window, softcap)
    out = q.new_empty(t, heads * d)
    for group in groups:  # at most two: decode, prefill
        out[group.start:group.end] = _group_attention(q, k, v, cache, group, meta, window,
                                                      softcap)
    return out


def _group_attention(q: Tensor, k: Tensor, v: Tensor, cache: KVCache, g: AttentionGroup,
                     meta: AttentionMetadata, window: int | None = None,
                     softcap: float | None = None) -> Tensor:
    _, heads, d = q.shape
    kv_heads = k.shape[1]
    gqa = heads // kv_heads
    q = q[g.start:g.end]
    decode_kernel = meta.decode_kernel
    if g.q_starts is not None:  # built for the native kernel (StepLayout.native_prefill)
        assert meta.prefill_kernel is not None and g.context_lens is not None
        o = meta.prefill_kernel(q.contiguous(), cache.k, cache.v, g.block_tables, g.q_starts,
                                g.context_lens, d ** -0.5, window or 0, softcap or 0.0)
        return o.view(g.end - g.start, heads * d)
    if g.fresh:
        return _causal_attention(q, k[g.start:g.end], v[g.start:g.end], g.mask, softcap)
    if g.q_len == 1 and decode_kernel is not None and g.context_lens is not None:
        o = decode_kernel(q.contiguous(), cache.k, cache.v, g.block_tables, g.context_lens,
                          d ** -0.5, window or 0, softcap or 0.0)
        return o.view(g.batch, heads * d)
    keys, values = cache.gather(g.block_tables)
    if g.q_len == 1:  # decodes: torch's GQA path is quicker than folding for one query
        o = _sdpa(q.view(g.batch, heads, 1, d), keys, values, g.mask, softcap)
        return o.reshape(g.batch, heads * d)
    if g.scatter is not None:
        padded = q.new_zeros(g.batch * g.q_len, heads, d)
        q = padded.index_copy_(0, g.scatter, q)
    # [B*Q, kv, gqa, d] -> [B, kv, gqa*Q, d]: the heads sharing a KV head become extra queries
    qf = q.view(g.batch, g.q_len, kv_heads, gqa, d).permute(0, 2, 3, 1, 4)
    qf = qf.reshape(g.batch, kv_heads, gqa * g.q_len, d)
    o = _sdpa(qf, keys, values, g.mask, softcap)
    o = o.view(g.batch, kv_heads, gqa, g.q_len, d).permute(0, 3, 1, 2, 4)
    o = o.reshape(g.batch * g.q_len, heads * d)
    return o if g.scatter is None else o.index_select(0, g.scatter)


def _causal_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None,
                      softcap: float | None = None) -> Tensor:
    """One sequence's first chunk: plain causal attention over its own new tokens (or
    under `mask` `[T, T]`, a sliding window's)."""
    t, heads, d = q.shape
    # 4-D inputs: with 3-D ones torch's CPU dispatch falls back to the (3x slower) math kernel
    o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
              mask, softcap)
    return o[0].transpose(0, 1).reshape(t, heads * d)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
          softcap: float | None) -> Tensor:
    """`[B, heads, Q, d]` against `[B, kv_heads, L, d]` (kv_heads divides heads): SDPA
    under the additive `mask` (None: causal); with a `softcap` (which SDPA has no
    argument for) the scores are computed out, capped, masked and soft-maxed in float32,
    as transformers' eager attention does for Gemma 2."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=q.shape[1] != k.shape[1])
    assert mask is not None, "soft-capped attention takes its mask spelled out"
    b, heads, rows, d = q.shape
    groups = heads // k.shape[1]
    if groups > 1:  # the query heads sharing a KV head as more rows of it (no K/V copies)
        q = q.reshape(b, k.shape[1], groups * rows, d)
        mask = mask.repeat(groups, 1) if mask.dim() == 2 else mask.repeat(1, 1, groups, 1)
    scores = (q @ k.transpose(-1, -2)) * d ** -0.5
    scores = torch.tanh(scores / softcap) * softcap + mask
    out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    return out.reshape(b, heads, rows, d)


def build_group(start: int, q_lens: list[int], start_positions: list[int],
                block_tables: list[list[int]], layout: StepLayout) -> AttentionGroup:
    """Metadata for one group of sequences (the step's decodes, or its prefill chunks).
    Prefill chunks for the native kernel (`layout.native_prefill`) get their block
    tables, each chunk's first row in the group and the tokens its last row sees; no
    padding, no mask."""
    batch, q_len, bs = len(q_lens), max(q_lens), layout.block_size
    end = start + sum(q_lens)
    native = layout.native_prefill and q_len > 1
    new_lens, firsts = tuple(q_lens), tuple(start_positions)  # for `masked`
    if batch == 1 and start_positions[0] == 0 and not native:
        return AttentionGroup(start, end, 1, q_len, torch.empty(0, 1, dtype=torch.long),
                              None, fresh=True, q_lens=new_lens,
                              start_positions=firsts)
    n_blocks = max((s + n + bs - 1) // bs for s, n in zip(start_positions, q_lens, strict=True))
    table = torch.tensor([bt[:n_blocks] + [0] * (n_blocks - len(bt[:n_blocks]))
                          for bt in block_tables], dtype=torch.long).to(layout.device)
    lens = torch.tensor([s + n for s, n in zip(start_positions, q_lens, strict=True)],
                        dtype=torch.long, device=layout.device)
    if native:
        q_starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.long)
        return AttentionGroup(start, end, batch, q_len, table, None, context_lens=lens,
                              q_starts=q_starts, q_lens=new_lens, start_positions=firsts)
    mask, scatter = _padded_mask(q_lens, start_positions, n_blocks * bs, layout)
    return AttentionGroup(start, end, batch, q_len, table, mask, scatter=scatter,
                          context_lens=lens, q_lens=new_lens, start_positions=firsts)


def _padded_mask(q_lens: Sequence[int], start_positions: Sequence[int], n_keys: int,
                 layout: StepLayout, window: int | None = None) -> tuple[Tensor, Tensor | None]:
    """The additive mask `[B, 1, gqa*Q, n_keys]` (`[B, 1, 1, n_keys]` for decodes) of
    queries padded to the longest, causal and, given a `window`, hiding the keys `window`
    or more positions back; and the rows of the real queries among the padded ones
    (None when none is padded)."""
    batch, q_len = len(q_lens), max(q_lens)
    # query positions [B, Q]: padding rows get position 0 (they see one real key: no NaN)
    q_pos = torch.zeros(batch, q_len, dtype=torch.long)
    rows: list[int] = []
    for i, (s, n) in enumerate(zip(start_positions, q_lens, strict=True)):
        q_pos[i, :n] = torch.arange(s, s + n)
        rows.extend(range(i * q_len, i * q_len + n))
    key_pos = torch.arange(n_keys).view(1, 1, -1)
    if layout.bidirectional:  # every key of the query's own sequence, within the window
        ends = torch.tensor([s + n for s, n in zip(start_positions, q_lens, strict=True)])
        hidden = (key_pos >= ends.view(-1, 1, 1)).expand(batch, q_len, n_keys).clone()
        if window is not None:
            hidden |= (key_pos - q_pos.unsqueeze(-1)).abs() >= window
    else:
        hidden = key_pos > q_pos.unsqueeze(-1)  # [B, Q, L]
        if window is not None:
            hidden |= key_pos <= q_pos.unsqueeze(-1) - window
    hidden = hidden.unsqueeze(1)  # [B, 1, Q, L]
    mask = torch.zeros(hidden.shape, dtype=layout.dtype).masked_fill_(hidden, float("-inf"))
    if q_len > 1:
        mask = mask.repeat(1, 1, layout.gqa, 1)
    dense = all(n == q_len for n in q_lens)
    scatter = None if dense else torch.tensor(rows, dtype=torch.long, device=layout.device)
    return mask.to(layout.device), scatter


def _masked_group(g: AttentionGroup, window: int | None, layout: StepLayout) -> AttentionGroup:
    """`g` under its mask spelled out, which also hides keys `window` or more positions
    back (given one), for the padded SDPA path (or a first chunk's plain attention under
    the mask): where no native kernel takes the group, or the scores are capped."""
    if g.fresh:
        n = g.end - g.start
        pos = torch.arange(n)
        if layout.bidirectional:
            distance = (pos.view(1, -1) - pos.view(-1, 1)).abs()
            hidden = distance >= (window if window is not None else n)
        else:
            hidden = pos.view(1, -1) > pos.view(-1, 1)
            if window is not None:
                hidden |= pos.view(1, -1) <= pos.view(-1, 1) - window
        mask = torch.zeros(n, n, dtype=layout.dtype).masked_fill_(hidden, float("-inf"))
        return replace(g, mask=mask.to(layout.device))
    mask, scatter = _padded_mask(g.q_lens, g.start_positions,
                                 g.block_tables.shape[1] * layout.block_size, layout, window)
    return replace(g, mask=mask, scatter=scatter, context_lens=None, q_starts=None)
