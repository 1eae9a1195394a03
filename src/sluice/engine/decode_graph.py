"""A decode step of every layer and the head in one native call, on GGUF blocks.

One stream's decode step is small: at one row SmolLM2-135M's linears read ~96 MB of
GGUF blocks, a few milliseconds of memory traffic. The torch model runs it as ~10 ops
a layer called from Python (norms, the fused QKV, RoPE's reshapes, the K/V write, the
attention, SwiGLU, the residuals), each with its dispatch, its output allocation and,
for the parallel ones, an OpenMP fork/join: 30 layers make ~300 of them, and their
overhead was as large as the weights' reading (docs/bench.md, llama.cpp comparison).
llama.cpp runs the same step as one C graph.

`DecodeGraph` is that for sluice: with `--quantization gguf`, when every linear of the
model (layers and head) is on supported GGUF blocks (sluice.engine.quant), the runner
builds the native `DecodeGraph` once over the blocks, the norms' weights and the layers'
KV pools, and sends it every step whose chunks are all decodes or speculative verifies
(one query a row) of at most `max_rows` rows, each row adding its adapter's products
where multi-LoRA is on (`set_lora`); other steps (prefill, larger batches) take the
torch model. Both write the same K/V rows into the same pools, so a sequence moves
between the two paths from step to step. Activations are float32 in the graph (the KV
pool keeps its dtype). Where the CPU has AVX2 (`q4_int8_path`), the
Q4 linears take them as integers: each 32-value block as two int8 vectors with one
scale, x ~ dx (q1 + q2 / 256), so a block's dot product with the nibbles is integer
multiply-adds (AVX512-VNNI's vpdpbusd: 64 a instruction) instead of converting every
weight to float. llama.cpp keeps q1 alone; that cost this model 1.4% of perplexity,
the pair 0.02% (csrc/cpu_kernels.cpp, tests/engine/test_decode_graph.py). With float
activations (`int8_activations=False`) the graph follows the torch path on the same
blocks within float rounding.

    row          token  position  KV slot                            table    attends to
    decode A     a41    41        table_A[41 // bs] * bs + 41 % bs   table_A  0..41
    verify B, 0  b9     9         table_B[9 // bs] * bs + 9 % bs     table_B  0..9
    verify B, 1  b10    10        table_B[10 // bs] * bs + 10 % bs   table_B  0..10

The same graph runs over float32 weights on the native panels (`build_float`) and over
bfloat16 weights on AMX tiles or with AVX512-BF16's pair dot products (`build_bf16`);
those take every decode step, any rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from sluice.engine.lora import LoRALinear
from sluice.engine.models.llama import (
    MLP_ACTIVATIONS,
    Linear,
    ResidualAdd,
    RMSNorm,
    Transformer,
    TransformerBlock,
    rope_tables,
)
from sluice.engine.native import NativeOps, bf16_packable

if TYPE_CHECKING:
    from sluice.engine.lora import LoRASlots
    from sluice.engine.model_runner import SeqChunk

# rows up to which a decode step runs as the graph: past 8 the torch model's oneDNN GEMM
# on the dense weights wins (bfloat16, AVX512-BF16 here: 9 rows 23.3 vs 29.2 ms, 16 rows
# 29.2 vs 43.3; 8 rows 23.9 vs 24.6; 1 row 9.7 vs 6.3)
GRAPH_MAX_ROWS = 8
# ... except on the column tiles (AVX512-VNNI builds), where the GGUF graph stays ahead
# of the dense weights through 64 rows (Zen 4, R decodes at context 200, ms: 32 rows
# 43.9 vs 60.6 on the float32 panels' graph, 36.8 vs 45.6 on the bfloat16 torch model;
# 64 rows 103.0 vs 137.8 and 75.4 vs 81.7; 96 rows 115.5 vs 112.2 bfloat16:
# benchmarks/decode_graph_rows.py --decodes --vs-dense). Up to here a sequence's greedy
# tokens do not depend on how many rows share its steps (every row computed alike).
TILES_GRAPH_MAX_ROWS = 64
# float32 on panels: the graph runs the same kernels as the torch model, without its
# ~10 calls a layer from Python, so it takes every decode step
FLOAT_GRAPH_MAX_ROWS = 1 << 16
F32 = 0  # ggml type: the graph's float32 linears (a weight and its panels)
BF16 = 30  # ggml type: the graph's bfloat16 linears (a weight and its pack_bf16)
NONE = torch.empty(0)  # the graph's "none": a norm a block lacks, no local RoPE tables


class DecodeGraph:
    """The native graph over a model's GGUF blocks and KV pools, and the step filter."""

    def __init__(self, model: Transformer, graph: Any, max_rows: int) -> None:
        self.model = model
        self.graph = graph
        self.max_rows = max_rows
        self.head_tiles: Tensor | None = None  # a bfloat16 graph's packed output head
        assert model.rope_cos is not None, "init_rope first"
        # float32 RoPE tables (the model's are in its dtype, bfloat16 on some CPUs), and
        # the sliding layers' own where they have them (Gemma 3's, OLMo 3's)
        cfg, positions = model.cfg, model.rope_cos.shape[0]
        self.cos, self.sin = rope_tables(cfg.rope, cfg.rotary_dim, positions)
        self.local: tuple[Tensor, Tensor] | None = None
        if model.local_rope is not None and cfg.local_rope is not None:
            self.local = rope_tables(cfg.local_rope, cfg.rotary_dim, positions)

    @classmethod
    def build(cls, model: Transformer, blocks: Mapping[str, tuple[Tensor, int]],
              native: NativeOps | None, max_rows: int | None = None,
              int8_activations: bool | None = None) -> DecodeGraph | None:
        """The graph, or None where it cannot run: no native kernels, or a linear that is
        not on GGUF blocks (a type the kernel does not take, or a side other than the
        runner's multi-LoRA).
        `int8_activations`: the activations of the linears whose type the build takes
        (`int8_activation_types`: Q4_0 and Q4_1; the Q8_0 head too with AVX512-VNNI) as
        int8 pairs per block (None: where this machine's build has a vector path).
        `max_rows`: the steps it takes (None: 64 rows on the column tiles, else 8)."""
        if native is None or native.decode_graph is None or native.q4_int8_path is None:
            return None
        if int8_activations is None:
            int8_activations = bool(native.q4_int8_path())
        if max_rows is None:
            tiles = int8_activations and native.q4_int8_path() == "avx512_vnni"
            max_rows = TILES_GRAPH_MAX_ROWS if tiles else GRAPH_MAX_ROWS
        names = _linear_names(model)
        linears = _linears(model, names)
        if linears is None or any(n not in blocks for n in names):
            return None
        int8_types = set(native.int8_activation_types()) if native.int8_activation_types else set()
        int8 = [int8_activations and blocks[n][1] in int8_types for n in names]
        return cls._build(model, native, linears, [blocks[n][0] for n in names],
                          [blocks[n][1] for n in names], int8, [torch.empty(0)] * len(names),
                          max_rows)

    @classmethod
    def build_float(cls, model: Transformer, native: NativeOps | None,
                    panel_of: Mapping[Linear, Any] | None = None,
                    max_rows: int = FLOAT_GRAPH_MAX_ROWS,
                    head: tuple[Tensor, int] | None = None) -> DecodeGraph | None:
        """The graph over a float32 model whose every linear is on native panels
        (`PanelLinear`: each linear's matmul, or its entry in `panel_of`): the panels for
        more than 4 rows, the plain weight (the GEMV) for up to 4. None where it cannot run
        (no native kernels, a linear not on panels). `head`: the LM head's
        GGUF blocks and type, run as the GGUF graph runs them (`_with_head`)."""
        from sluice.engine.native import PanelLinear

        if native is None or native.decode_graph is None:
            return None
        linears = _linears(model, _linear_names(model))
        if linears is None:
            return None
        of = panel_of or {}
        found = [of.get(m, m.matmul) for m in linears]
        panels = [p for p, m in zip(found, linears, strict=True)
                  if isinstance(p, PanelLinear) and p.weight is m.weight]
        if len(panels) != len(linears):
            return None
        return cls._build(model, native, linears, *_with_head(
            native, head, [p.weight for p in panels], [F32] * len(panels), [False] * len(panels),
            [p.panels for p in panels]), max_rows)

    @classmethod
    def build_bf16(cls, model: Transformer, native: NativeOps | None,
                   max_rows: int = FLOAT_GRAPH_MAX_ROWS,
                   head: tuple[Tensor, int] | None = None) -> DecodeGraph | None:
        """The graph over a bfloat16 model on AMX tiles or AVX512-BF16
        (`bf16_linear_path`): each linear's weight packed once (`pack_bf16`), activations
        float32 between the linears and rounded to bfloat16 at each linear's input (the
        torch model rounds every op's output). None where it cannot run (neither path
        here, a shape the packing does not divide: N % 16, K % 32)."""
        if (native is None or native.decode_graph is None or native.bf16_linear_path is None
                or native.pack_bf16 is None or not native.bf16_linear_path()):
            return None
        linears = _linears(model, _linear_names(model))
        if linears is None:
            return None
        weights = [m.weight.detach() for m in linears]
        if not all(bf16_packable(w) for w in weights):
            return None
        tiles = [native.pack_bf16(w) for w in weights]
        graph = cls._build(model, native, linears, *_with_head(
            native, head, weights, [BF16] * len(weights), [False] * len(weights), tiles),
            max_rows)
        graph.head_tiles = tiles[-1]  # the prefill's head shares them (`FloatHead`)
        return graph

    @classmethod
    def _build(cls, model: Transformer, native: NativeOps, linears: list[Linear],
               weights: list[Tensor], types: list[int], int8: list[bool],
               panels: list[Tensor], max_rows: int) -> DecodeGraph:
        assert native.decode_graph is not None
        cfg = model.cfg
        norms: list[Tensor] = []  # 4 a layer, an empty tensor where the block has none
        qk_norms: list[RMSNorm] = []  # a Q and a K norm a layer: of each head, or all heads
        k_pools, v_pools = [], []
        for layer in model.layers:
            assert isinstance(layer, TransformerBlock)
            norms += [_norm(layer.attention_norm), _norm(layer.post_attention_norm),
                      _norm(layer.ffn_norm), _norm(layer.post_ffn_norm)]
            if layer.attention.q_norm is not None and layer.attention.k_norm is not None:
                qk_norms += [layer.attention.q_norm, layer.attention.k_norm]
            assert layer.attention.kv_cache is not None, "KV cache not allocated"
            k_pools.append(layer.attention.kv_cache.k)
            v_pools.append(layer.attention.kv_cache.v)
        norms.append(_norm(model.norm))
        softcap = cfg.gemma.attn_softcap if cfg.gemma is not None else None  # Gemma 2's
        local = model.local_rope is not None  # the sliding layers rotate with their own
        ropes = [0 if not cfg.uses_rope(i) else 2 if local and cfg.window(i) is not None else 1
                 for i in range(cfg.num_layers)]
        graph = native.decode_graph(
            weights, types,
            [_float(m.bias) if m.bias is not None else torch.empty(0) for m in linears],
            norms, k_pools, v_pools,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, int8, panels,
            [_float(n.weight) for n in qk_norms], ropes,
            [cfg.window(i) or 0 for i in range(cfg.num_layers)],
            MLP_ACTIVATIONS.index(cfg.mlp_activation), softcap or 0.0)
        sides = [m.lora for m in linears]
        lora = next((s for s in sides if isinstance(s, LoRALinear)), None)
        if lora is not None:  # multi-LoRA: every row adds its slot's products
            graph.set_lora([s.a if isinstance(s, LoRALinear) else NONE for s in sides],
                           [s.b if isinstance(s, LoRALinear) else [] for s in sides],
                           [s.offsets if isinstance(s, LoRALinear) else [] for s in sides],
                           lora.rank, lora.slots)
        return cls(model, graph, max_rows)

    def takes(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step runs here: every chunk one-query rows (a decode, or a verify:
        every token's logits wanted), at most `max_rows` rows in all."""
        rows = sum(len(c.token_ids) for c in chunks)
        return rows <= self.max_rows and all(c.one_query_rows for c in chunks)

    def execute(self, chunks: list[SeqChunk], block_size: int,
                lora: LoRASlots | None = None) -> Tensor:
        """`ModelRunner.execute` of a step it `takes` (chunks already checked): rows in
        chunk order, the logits of the rows that want them. `lora`: the runner's adapter
        slots (each row adds its chunk's adapter's products)."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        wanted: list[int] = []
        row_slots: list[int] = []
        chunk_slots = (lora.assign([c.lora for c in chunks])
                       if lora is not None and any(c.lora is not None for c in chunks) else None)
        for i, c in enumerate(chunks):
            if chunk_slots is not None:
                row_slots += [chunk_slots[i]] * len(c.token_ids)
            for j, token in enumerate(c.token_ids):
                pos = c.start_pos + j
                if c.need_logits and j >= len(c.token_ids) - c.num_logits:
                    wanted.append(len(tokens))
                tokens.append(token)
                positions.append(pos)
                slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
                tables.append(c.block_table)
        logits = self.forward(tokens, positions, slots, tables, row_slots)
        return logits if len(wanted) == len(tokens) else logits[wanted]

    def forward(self, tokens: list[int], positions: list[int], slots: list[int],
                tables: list[list[int]], lora_slots: list[int] | None = None) -> Tensor:
        """float32 logits `[rows, vocab]` of one-query rows: each row's token, position,
        KV slot and block table (its context is positions 0..position), and its LoRA slot
        (-1: the base; none: every row the base). Writes the rows' K/V into the pools."""
        pos = torch.tensor(positions, dtype=torch.long)
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        x = self.model.embed(torch.tensor(tokens, dtype=torch.long)).float()
        lcos, lsin = (self.local[0][pos], self.local[1][pos]) if self.local else (NONE, NONE)
        logits = self.graph.forward(x, self.cos[pos], self.sin[pos],
                                    torch.tensor(slots, dtype=torch.long), padded, pos + 1,
                                    lcos, lsin,
                                    torch.tensor(lora_slots, dtype=torch.long) if lora_slots
                                    else NONE)
        cap = self.model.cfg.gemma.final_softcap if self.model.cfg.gemma is not None else None
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _with_head(native: NativeOps, head: tuple[Tensor, int] | None, weights: list[Tensor],
               types: list[int], int8: list[bool], panels: list[Tensor]
               ) -> tuple[list[Tensor], list[int], list[bool], list[Tensor]]:
    """The dense graph's linears with its LM head (the last) on the GGUF blocks where
    the GGUF graph takes them on integer activations (the Q8_0 head with AVX512-VNNI):
    a sequence's logits then come from one kernel whether its step ran on the GGUF
    graph or (past its rows) this one, so its greedy tokens do not depend on how many
    rows shared its steps as often."""
    if head is None or native.int8_activation_types is None:
        return weights, types, int8, panels
    blocks, ggml_type = head
    if ggml_type not in native.int8_activation_types():
        return weights, types, int8, panels
    return ([*weights[:-1], blocks], [*types[:-1], ggml_type], [*int8[:-1], True],
            [*panels[:-1], torch.empty(0)])


def _linear_names(model: Transformer) -> list[str]:
    """The graph's linears: 4 a layer, then the head."""
    return [f"layers.{i}.{part}" for i in range(len(model.layers))
            for part in ("attention.wqkv", "attention.wo", "feed_forward.w13",
                         "feed_forward.w2")] + ["output"]


def _linears(model: Transformer, names: list[str]) -> list[Linear] | None:
    """The modules of `names`, or None if one is not a Linear or has a side the graph
    does not run (other than the runner's multi-LoRA, `LoRALinear`)."""
    modules = dict(model.named_modules())
    linears = [modules.get(n) for n in names]
    if any(not isinstance(m, Linear) or not isinstance(m.lora, LoRALinear | None)
           for m in linears):
        return None
    return linears  # type: ignore[return-value]


def _norm(norm: RMSNorm | ResidualAdd | None) -> Tensor:
    """A block norm's float32 weight for the graph, an empty tensor where there is none."""
    return _float(norm.weight) if isinstance(norm, RMSNorm) else NONE


def _float(t: Tensor) -> Tensor:
    return t.detach().float().contiguous()
