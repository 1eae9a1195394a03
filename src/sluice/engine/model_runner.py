"""Tensors in, logits out: one forward pass over every sequence's new tokens of a step.

The engine hands over `SeqChunk`s (token ids, the position they start at, the block
table). The runner flattens them into one `[T]` batch — decodes first, then prefill
chunks — builds the slot mapping and the per-group attention metadata once, runs the
model under `torch.inference_mode()`, and returns the logits of the chunks that asked
for them, in the order given:

    chunks   A: decode pos 41   B: prefill 0..5 (need_logits)   C: decode pos 9
    flat     [A41, C9, B0, B1, B2, B3, B4, B5]       groups: decode{A,C}, prefill{B}
    logits   rows for A, B (last token), C — in chunk order

The KV pool (one K and one V tensor per layer, `[num_blocks, block_size, kv_heads,
head_dim]`) is allocated here, sized from `CacheConfig`; the engine only ever sees
block ids.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from sluice.engine.attention import (
    AttentionGroup,
    AttentionMetadata,
    KVCache,
    StepLayout,
    build_group,
)
from sluice.engine.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig
from sluice.engine.decode_graph import DecodeGraph
from sluice.engine.lora import (
    LoRAAdapter,
    LoRALinear,
    LoRASlots,
    StepLoRA,
    fused_parts,
    load_adapter,
    module_shapes,
)
from sluice.engine.models.llama import (
    FeedForward,
    Linear,
    LlamaConfig,
    TransformerBlock,
    lora_output_rows,
)
from sluice.engine.models.loader import load_model
from sluice.engine.native import (
    SMALL_ROWS_MAX,
    FloatHead,
    NativeOps,
    PackedLinear,
    PackedSwiGLU,
    PanelLinear,
    cpu_flags,
    cpu_linear,
    native_ops,
    onednn_packing,
    onednn_swiglu,
    panel_rows_max,
    swiglu_rows_min,
    with_small_rows,
)
from sluice.engine.pooling import (
    Pooler,
    chunk_rows,
    parse_pooler_config,
    pooled_rows,
    resolve_pooler,
)
from sluice.engine.tokenizer import (
    Tokenizer,
    default_served_name,
    load_tokenizer,
    local_model_path,
)
from sluice.protocol.errors import InvalidRequestError

log = logging.getLogger("sluice.engine")

CPU_KV_CACHE_CAP_BYTES = 4 * 1024**3
WARM_UP_TOKENS = 9  # the warm-up's prefill (8 tokens) and decode (1)

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}


@dataclass
class SeqChunk:
    """One sequence's slice of work in a step."""

    token_ids: list[int]  # the new tokens to compute this step (len >= 1)
    start_pos: int  # = num_computed_tokens; tokens sit at start_pos .. start_pos+len-1
    block_table: list[int]  # KV block ids covering >= start_pos+len tokens
    need_logits: bool  # True if the last token's logits are needed
    lora: LoRAAdapter | None = None  # the sequence's adapter (multi-LoRA), or the base
    num_logits: int = 1  # logit rows: the last `num_logits` tokens' (speculative verify)
    prompt_logits: bool = False  # every token's logits, run as a prefill (prompt logprobs)
    # an embedding's chunk (sluice.engine.pooling's type): no logits; one pooled row
    pool: str = ""

    @property
    def one_query_rows(self) -> bool:
        """A decode, or a speculative verify (every token's logits wanted): its tokens run
        as one-query decodes of growing context over the same block table (K/V are
        written before attention reads them, so each draft sees the ones before it)."""
        return len(self.token_ids) == 1 or (self.num_logits == len(self.token_ids)
                                            and not self.prompt_logits)


# CPU flags of native bfloat16 math: AVX512-BF16's dot products, AMX's tiles. Without
# them torch emulates bfloat16 (convert, compute in float32, round), slower than float32.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def auto_dtype(device: torch.device, flags: frozenset[str]) -> torch.dtype:
    """`dtype="auto"`: bfloat16 on CUDA and on a CPU with native bfloat16 (`flags` has
    avx512_bf16 or amx_bf16), float32 otherwise, e.g. on AVX2-only CPUs."""
    if device.type == "cuda" or (device.type == "cpu" and flags & NATIVE_BF16_CPU_FLAGS):
        return torch.bfloat16
    return torch.float32


def resolve_device(cfg: ModelConfig) -> tuple[torch.device, torch.dtype]:
    """"auto" device: CUDA when available, else CPU; "auto" dtype: see `auto_dtype`."""
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r}: no CUDA device is available to torch "
                                  f"(torch {torch.__version__})", param="device")
    device = torch.device(name)
    if cfg.dtype != "auto":
        return device, DTYPES[cfg.dtype]
    return device, auto_dtype(device, cpu_flags() if device.type == "cpu" else frozenset())


def kv_block_bytes(cfg: LlamaConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def kv_pool_blocks(cache: CacheConfig, block_bytes: int, device: torch.device) -> int:
    """Blocks in the pool: explicit count, else explicit bytes, else a share of memory."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    else:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = min(int(ram * cache.cpu_kv_cache_fraction), CPU_KV_CACHE_CAP_BYTES)
    blocks = budget // block_bytes
    if blocks < 1:
        raise InvalidRequestError(f"KV cache budget of {budget} bytes is smaller than one block "
                                  f"({block_bytes} bytes)", param="kv_cache_memory_bytes")
    return int(blocks)


class ModelRunner:
    """Owns the weights, the tokenizer and the KV pool; `execute` runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        mc = config.model
        self.device, self.dtype = resolve_device(mc)
        if self.device.type == "cpu" and mc.cpu_threads is not None:
            torch.set_num_threads(mc.cpu_threads)
        self.model, self.model_config = load_model(mc.model, self.device, self.dtype, mc.revision,
                                                   mc.overrides())
        self.tokenizer: Tokenizer = load_tokenizer(mc.tokenizer or mc.model, mc.revision)
        self.labels = self.model_config.labels  # a classifier's (its `score` head)
        self.pooler = self._pooler(mc)
        self.model_name: str = mc.served_model_name or default_served_name(mc.model)
        self.vocab_size: int = self.model_config.vocab_size
        self.max_model_len: int = self._max_model_len(mc)
        self.block_size: int = config.cache.block_size
        block_bytes = kv_block_bytes(self.model_config, self.block_size, self.dtype)
        self.num_kv_blocks: int = kv_pool_blocks(config.cache, block_bytes, self.device)
        self.kv_cache_bytes: int = self.num_kv_blocks * block_bytes
        self._allocate_kv_cache()
        self.model.init_rope(self.max_model_len)
        # what, besides the model, makes this pool's blocks differ from another worker's
        # of the same model: the RoPE the served context decides (longrope's factor list,
        # dynamic NTK's base)
        rope = self.model_config.rope
        self.rope_variant = rope.context_variant(self.max_model_len)
        if self.rope_variant:
            log.info("RoPE: %s for every sequence (max_model_len %d, original context %s)",
                     self.rope_variant, self.max_model_len,
                     rope.params["original_max_position_embeddings"])
        self.native = native_ops(mc.kernel_backend, self.device, self.dtype)
        # prefill chunks' attention straight from the pool (sluice.engine.attention)
        self.native_prefill = (self.native is not None
                                and self.native.paged_prefill_attention is not None
                                and self.model_config.head_dim % 16 == 0
                                and not self.model_config.bidirectional)
        # a bidirectional model (EmbeddingGemma) is an embedding model run as an encoder:
        # the core turns chunked prefill and prefix caching off and refuses generation
        self.encoder_only = self.model_config.bidirectional
        if self.native is not None:
            self.model.use_fused_kernels(self.native.fused_add_rms_norm,
                                         self.native.silu_and_mul, self.native.rotary_embedding)
        self.linear = cpu_linear(mc.kernel_backend, self.device, self.dtype)
        if self.native is not None:  # a few rows' linears (one stream's decode): a GEMV
            self.linear = with_small_rows(self.native, self.linear or F.linear)
        if self.linear is not None:
            self.model.use_linear(self.linear)
        self.gguf_blocks: dict[str, tuple[Tensor, int]] = {}  # linears on GGUF blocks
        self.panels = False  # float32 linears on native panels
        panel_of: dict[Linear, PanelLinear] = {}
        if mc.quantization == "int8":
            self._use_int8_weights()
        elif self.native is not None and self.dtype == torch.float32:
            panel_of = self._use_panels(self.native)
            self.panels = True
        elif self.linear is not None and onednn_packing(self.dtype):
            self._pack_weights()
        if mc.quantization == "gguf":  # the blocks for a few rows, the (packed) dense above
            self.gguf_blocks = self._use_gguf_weights(mc)
        cfg = self.model_config
        # (Arcee's MLP is up_proj alone; a mixture of experts' adapters are its attention's)
        gated, mlp = cfg.mlp_activation != "relu2", cfg.moe is None
        self.lora_shapes = module_shapes(cfg.hidden_size, cfg.intermediate_size, cfg.q_size,
                                         cfg.kv_size, gated, mlp)
        self.lora_parts = fused_parts(self.lora_shapes)
        self.lora_slots: LoRASlots | None = None
        self.pooled: list[Tensor] | None = None  # the last step's pooled rows (`execute`)
        if config.lora.enable_lora:
            self.lora_slots = self._add_lora_slots(config.lora)
        # decode steps as one native call: `decode_graph` first; with GGUF blocks (a graph
        # of up to 8 rows, 64 on the column tiles) `wide_graph` takes the larger steps on
        # the dense weights
        self.decode_graph: DecodeGraph | None = None
        self.wide_graph: DecodeGraph | None = None
        # the graph's layers are dense (any block norms, Q/K norms, activation, NoPE and
        # sliding layers, capped scores): not a mixture of experts
        if not mc.enforce_eager and cfg.moe is None and not cfg.bidirectional:
            dense = None
            head = self.gguf_blocks.get("output")  # the GGUF graph's head kernel, both graphs
            if self.panels:
                dense = DecodeGraph.build_float(self.model, self.native, panel_of, head=head)
            elif self.dtype == torch.bfloat16:
                dense = DecodeGraph.build_bf16(self.model, self.native, head=head)
            if self.gguf_blocks:
                self.decode_graph = DecodeGraph.build(self.model, self.gguf_blocks, self.native)
                self.wide_graph = dense
            else:
                self.decode_graph = dense
        if self.dtype == torch.bfloat16 and not self.gguf_blocks:
            self._float_logits(self.decode_graph)
        self.warm_up()

    def _float_logits(self, graph: DecodeGraph | None) -> None:
        """A bfloat16 model's prefill logits in float32, as its decode graph's are
        (`FloatHead`), on the graph's packed head where there is one."""
        head = self.model.output
        if head.lora is not None:
            return
        packed = graph.head_tiles if graph is not None else None
        float_head = FloatHead.build(head.weight, self.native, head.matmul, packed)
        if float_head is not None:
            head.matmul = float_head

    def _use_panels(self, native: NativeOps) -> dict[Linear, PanelLinear]:
        """Every float32 linear on the native panel kernel (`PanelLinear`); one stream's
        rows keep going to the GEMV, and on AMX machines prefill-sized inputs to oneDNN
        (`panel_rows_max`). Returns each linear's panels (a GGUF route may wrap them
        later)."""
        most = panel_rows_max(cpu_flags())
        panel_of = {}
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.matmul = panel_of[module] = PanelLinear(module.weight, module.matmul,
                                                               native, SMALL_ROWS_MAX, most)
        return panel_of

    def _pack_weights(self) -> None:
        """Every linear on its weight reordered once for oneDNN (`PackedLinear`); float32
        rows the native GEMV takes (one stream's decode) keep going there."""
        few = SMALL_ROWS_MAX if self.native is not None and self.dtype == torch.float32 else 0
        for module in self.model.modules():
            if isinstance(module, Linear):
                module.matmul = PackedLinear(module.weight, module.matmul, few)
        min_rows = swiglu_rows_min(cpu_flags())  # prefill's SwiGLU as two fused matmuls
        if self.dtype == torch.bfloat16 and min_rows is not None and onednn_swiglu(self.dtype):
            for module in self.model.modules():
                if (isinstance(module, FeedForward) and module.w13.bias is None
                        and isinstance(module.w13.matmul, PackedLinear)):
                    module.swiglu = PackedSwiGLU(module.w13.matmul, min_rows)

    def _use_gguf_weights(self, mc: ModelConfig) -> dict[str, tuple[Tensor, int]]:
        """Decode rows' linears on the GGUF file's own blocks (sluice.engine.quant)."""
        from sluice.engine.quant import use_gguf_weights
        from sluice.engine.tokenizer import local_model_path

        path = local_model_path(mc.model, mc.revision)
        if path.suffix != ".gguf":
            raise InvalidRequestError("quantization 'gguf' needs a .gguf model",
                                      param="quantization")
        return use_gguf_weights(self.model, path, self.native)

    def _pooler(self, mc: ModelConfig) -> Pooler:
        """How embeddings are read (sluice.engine.pooling): the checkpoint's own
        sentence-transformers pooling, `--pooler-config` over it; a classifier's input is
        its last token's state, as transformers' `*ForSequenceClassification` reads it."""
        if self.labels:
            if mc.pooler_config is not None:
                raise InvalidRequestError("pooler_config does not apply to a classifier (its "
                                          "scores are its classifier's)", param="pooler_config")
            return Pooler("LAST", False)
        path = local_model_path(mc.model, mc.revision)
        pooler = resolve_pooler(path if path.is_dir() else None,
                                parse_pooler_config(mc.pooler_config))
        if pooler != Pooler():
            log.info("embeddings: %s pooling%s", pooler.pooling_type,
                     ", normalized" if pooler.normalize else "")
        return pooler

    def _use_int8_weights(self) -> None:
        """Every linear on int8 weights with per-row scales (sluice.engine.quant)."""
        from sluice.engine.quant import use_int8_weights

        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidRequestError("quantization 'int8' needs float weights",
                                      param="quantization")
        size = use_int8_weights(self.model, self.native)
        log.info("int8 weights: %.1f MB (%s)", size / 1e6,
                 "native kernel" if self.native is not None else "torch ops")

    def _add_lora_slots(self, lc: LoRAConfig) -> LoRASlots:
        """A LoRA side on every targetable linear (zero weights until an adapter is put in
        a slot): `max_loras` slots of rank `max_lora_rank`."""
        step = StepLoRA(self.native.lora_bgmv if self.native is not None else None)
        per_layer: list[dict[str, LoRALinear]] = []
        for layer in self.model.layers:
            assert isinstance(layer, TransformerBlock)
            mlp = layer.feed_forward
            targets: dict[str, Linear] = {"qkv": layer.attention.wqkv, "o": layer.attention.wo}
            if "gate_up" in self.lora_parts:  # (not a mixture of experts': lora_parts)
                assert isinstance(mlp, FeedForward)
                targets |= {"gate_up": mlp.w13, "down": mlp.w2}
            linears: dict[str, LoRALinear] = {}
            for fused, linear in targets.items():
                parts = [self.lora_shapes[m] for m in self.lora_parts[fused]]
                offsets = [sum(out for _, out in parts[:i]) for i in range(len(parts))]
                lin = LoRALinear(parts, offsets, parts[0][0], lc.max_loras, lc.max_lora_rank,
                                 step, self.device, self.dtype)
                linear.lora = lin
                linears[fused] = lin
            per_layer.append(linears)
        return LoRASlots(per_layer, lc.max_loras, lc.max_lora_rank, step, self.lora_parts)

    def load_lora(self, path: str, max_rank: int) -> LoRAAdapter:
        """Read and check a PEFT adapter for this model (raises InvalidRequestError)."""
        cfg = self.model_config
        scales = (cfg.granite.lora_output_scales(cfg.head_dim) if cfg.granite
                  else cfg.gemma.lora_output_scales(cfg) if cfg.gemma else None)
        return load_adapter(path, self.lora_shapes, cfg.num_layers, max_rank, scales,
                            lora_output_rows(cfg))

    def _max_model_len(self, mc: ModelConfig) -> int:
        limit = self.model_config.max_position_embeddings
        if mc.max_model_len is None:
            return limit
        if mc.max_model_len > limit:
            raise InvalidRequestError(f"max_model_len {mc.max_model_len} exceeds the model's "
                                      f"limit of {limit}", param="max_model_len")
        return mc.max_model_len

    def _allocate_kv_cache(self) -> None:
        """Zeroed, and so touched, now: a lazily mapped pool would fault pages in while
        serving, which cost decode steps 15% (the K/V writes) until every block had been
        used once."""
        cfg = self.model_config
        shape = (self.num_kv_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        for layer in self.model.layers:
            assert isinstance(layer, TransformerBlock)
            layer.attention.kv_cache = KVCache(
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def warm_up(self) -> None:
        """A prefill and a decode through every layer, before the engine says it is ready,
        so the first request does not pay first-touch costs: the weights' pages (mapped
        from the weights cache), oneDNN's kernels for these shapes, OpenMP's threads.

        Writes K/V into block 0's slots only: no sequence owns a block yet, and a block's
        slots are always written before they are read.
        """
        length = min(WARM_UP_TOKENS, self.max_model_len)
        table = [0] * -(-length // self.block_size)
        if length > 1:
            self.execute([SeqChunk([0] * (length - 1), 0, table, True)])
        self.execute([SeqChunk([0], length - 1, table, True)])

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> Tensor:
        """Run one step; float32 logits, in order: one row per chunk with need_logits,
        `num_logits` rows (its last tokens') for a chunk verifying drafts. A chunk with
        `pool` has no logits row but an entry of `self.pooled` (float32, in chunk order,
        until the next step) from its tokens' final hidden states: LAST its last token's,
        CLS its first token's, MEAN their sum, ALL every one's (a classifier's: its
        logits of those); the engine core keeps what it needs.

        Mutates the KV pool: every new token's K/V is written at its slot.
        """
        self.pooled = None
        if not chunks:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        pooling = any(c.pool for c in chunks)
        for graph in (self.decode_graph, self.wide_graph):
            if not pooling and graph is not None and graph.takes(chunks):
                for c in chunks:
                    self._check(c)
                return graph.execute(chunks, self.block_size, self.lora_slots)
        order = self._flat_order(chunks)
        tokens, positions, slots, last_row = self._flatten(chunks, order)
        native = self.native
        cfg = self.model_config
        layout = StepLayout(self.block_size, cfg.num_heads // cfg.num_kv_heads, self.device,
                            self.dtype, self.native_prefill, cfg.bidirectional)
        meta = AttentionMetadata(self._tensor(slots), self._groups(chunks, order, layout),
                                 native.paged_decode_attention if native else None,
                                 native.paged_prefill_attention
                                 if native and self.native_prefill else None, layout)
        wanted = [row for i, c in enumerate(chunks) if c.need_logits and not c.pool
                  for row in range(last_row[i] - c.num_logits + 1, last_row[i] + 1)]
        if self.lora_slots is not None:
            self.lora_slots.prepare([(chunks[i].lora, len(chunks[i].token_ids)) for i in order],
                                    self.device, self.dtype)
        if not pooling:
            logits = self.model(self._tensor(tokens), self._tensor(positions), meta,
                                self._tensor(wanted))
            return logits.float()
        kinds = [c.pool for c in chunks if c.pool]
        pooled, sizes = pooled_rows((last_row[i] - len(c.token_ids) + 1, len(c.token_ids),
                                     c.pool) for i, c in enumerate(chunks) if c.pool)
        hidden = self.model.hidden(self._tensor(tokens), self._tensor(positions), meta,
                                   self._tensor(wanted + pooled))
        states = hidden[len(wanted):].float()
        if self.labels:  # a classifier's logits (of its last token's state, or each's)
            states = states @ self.model.get_buffer("classifier").float().T  # (load_model's)
        self.pooled = chunk_rows(states, sizes, kinds)
        return self.model.output(hidden[:len(wanted)]).float()

    def _tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    @classmethod
    def _flat_order(cls, chunks: list[SeqChunk]) -> list[int]:
        """Chunk indices in flat order: decodes (and verifies) first, then prefills."""
        decodes = [i for i, c in enumerate(chunks) if c.one_query_rows]
        return decodes + [i for i, c in enumerate(chunks) if not c.one_query_rows]

    def _flatten(self, chunks: list[SeqChunk],
                 order: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """Token ids, positions, KV slots of all new tokens; each chunk's last row."""
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row = [0] * len(chunks)
        bs = self.block_size
        for i in order:
            c = chunks[i]
            self._check(c)
            n, table = len(c.token_ids), c.block_table
            tokens.extend(c.token_ids)
            pos = range(c.start_pos, c.start_pos + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            last_row[i] = len(tokens) - 1
        return tokens, positions, slots, last_row

    def _check(self, c: SeqChunk) -> None:
        end = c.start_pos + len(c.token_ids)
        if not c.token_ids or c.start_pos < 0:
            raise InvalidRequestError("a chunk needs at least one token and start_pos >= 0")
        if end > self.max_model_len:
            raise InvalidRequestError(f"position {end - 1} is past max_model_len "
                                      f"{self.max_model_len}", param="max_model_len")
        used = c.block_table[:(end + self.block_size - 1) // self.block_size]
        if len(used) * self.block_size < end:
            raise InvalidRequestError(f"block table of {len(c.block_table)} blocks cannot hold "
                                      f"{end} tokens")
        if min(used) < 0 or max(used) >= self.num_kv_blocks:
            raise InvalidRequestError(f"block id out of range [0, {self.num_kv_blocks}) in "
                                      f"{used}")

    def _groups(self, chunks: list[SeqChunk], order: list[int],
                layout: StepLayout) -> list[AttentionGroup]:
        groups, start = [], 0
        num_decodes = self._num_decodes(chunks)
        for decodes, members in ((True, order[:num_decodes]), (False, order[num_decodes:])):
            if not members:
                continue
            picked = [chunks[i] for i in members]
            if decodes:  # one query per token (a verify's tokens: growing contexts)
                starts = [c.start_pos + j for c in picked for j in range(len(c.token_ids))]
                tables = [c.block_table for c in picked for _ in c.token_ids]
                group = build_group(start, [1] * len(starts), starts, tables, layout)
            else:
                group = build_group(start, [len(c.token_ids) for c in picked],
                                    [c.start_pos for c in picked],
                                    [c.block_table for c in picked], layout)
            groups.append(group)
            start = group.end
        return groups

    @classmethod
    def _num_decodes(cls, chunks: list[SeqChunk]) -> int:
        return sum(1 for c in chunks if c.one_query_rows)
