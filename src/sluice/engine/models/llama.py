"""The Llama family (Llama 2/3, SmolLM2/3, Mistral, Mixtral, Qwen2/2.5 and Qwen2-MoE, Qwen3
and Qwen3-MoE, Granite 3 and its MoE, Phi-3/4-mini, OLMoE, OLMo 2 and 3, EXAONE 4, Gemma 2
and 3, GLM-4, Helium, Arcee) as one model file.

Read it like the paper: each block is

    h   = x + attention(attention_norm(x))        # RMSNorm -> fused QKV -> RoPE -> paged attn
    out = h + feed_forward(ffn_norm(h))           # RMSNorm -> fused gate|up -> SwiGLU -> down

computed as vLLM does, with each residual add folded into the norm after it: a block
takes and returns `(x, residual)`, and `norm.add(x, residual)` is `residual += x;
x = norm(residual)` (one native kernel on CPU, see `sluice.engine.native`).

Mixtral, Qwen2-MoE, Qwen3-MoE, Granite's MoE and OLMoE put a mixture of experts where the
MLP is (`moe`; `SparseMoE`: a router, then the top-k of many such MLPs per token).

Differences between the members are data, not separate models: Qwen2 has a bias on Q/K/V
(`qkv_bias`), Qwen3 an RMSNorm over each Q and K head before RoPE (`qk_norm`; OLMoE one
over all of Q's heads and one over K's, `qk_norm_whole`), SmolLM3
leaves RoPE out of every fourth layer (`no_rope_layers`), Granite scales the embedding,
the branches, the attention scores and the logits by constants (`GraniteScales`, folded
into the weights at load: `fuse_hf_weights`), Llama 3 scales RoPE frequencies
(`rope_type`), some tie the output head to the embedding (`tie_word_embeddings`).
Gemma 2 and 3 (`GemmaConfig`) normalize each branch's output too (a norm after attention
and after the MLP), gate the MLP with GELU, scale the embedding by sqrt(hidden), and
attend through a sliding window in some layers (Gemma 3's with their own RoPE); Gemma 2
caps its attention scores and its logits with a tanh. OLMo 2 normalizes each branch's
output and not its input (`block_norms`: `ResidualAdd` where the input norms are);
OLMo 3 adds sliding windows as Gemma's (`sliding_window`, `sliding_layers`, `local_rope`),
EXAONE 4 per-head Q/K norms and, where it slides, global layers without RoPE; GLM-4-0414
normalizes both (`block_norms`). GLM rotates adjacent pairs (`rope_interleaved`: Q/K rows
reordered at load), Phi-4-mini and GLM part of each head (`partial_rotary_factor`).
Gemma gates its MLP with GELU, Arcee has no gate, relu(up)² (`mlp_activation`).
Weights arrive under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...)
from either loader and are fused here (Q|K|V into one matrix, gate|up into another) so a
layer does three big matmuls and one attention call over all of a step's tokens,
flattened to `[T, hidden]`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sluice.engine.attention import AttentionMetadata, KVCache, paged_attention
from sluice.engine.native import (
    ActivationKernel,
    AddNormKernel,
    LinearKernel,
    PackedSwiGLU,
    RopeKernel,
)
from sluice.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # a key of ROPE_FREQUENCY_SCALERS
    params: dict[str, Any] = field(default_factory=dict)  # factor, low_freq_factor, ...

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_FREQUENCY_SCALERS:
            raise InvalidRequestError(
                f"unsupported RoPE scaling type {self.rope_type!r} "
                f"(supported: {sorted(ROPE_FREQUENCY_SCALERS)})", param="model")
        missing = [k for k in ROPE_REQUIRED_PARAMS.get(self.rope_type, ()) if k not in self.params]
        if missing:
            raise InvalidRequestError(f"RoPE scaling {self.rope_type!r} needs "
                                      f"{', '.join(missing)} in rope_scaling", param="model")

    def past_original(self, context: int) -> bool:
        """Whether a served context is past the original one: longrope then takes its long
        factor list, else its short one (`_longrope_frequencies`); dynamic NTK raises its
        base, else leaves it (`_dynamic_frequencies`)."""
        return context > float(self.params["original_max_position_embeddings"])

    def context_variant(self, context: int) -> str:
        """What of this RoPE the served context decides, one choice for every sequence, so
        that KV blocks of one model differ by it between workers: longrope's factor list,
        dynamic NTK's raised base; "" where nothing is."""
        if self.rope_type == "longrope":
            return f"longrope {'long' if self.past_original(context) else 'short'} factors"
        if self.rope_type == "dynamic" and self.past_original(context):
            return f"dynamic NTK at {context}"
        return ""

    def scaled_context(self, context: int) -> int:
        """The context a model with this RoPE serves, `context` its config's own: under
        linear, YaRN or dynamic NTK scaling the original context (`context` where none is
        given) times the factor, vLLM's rule (Qwen2.5's YaRN, added to a config of 32,768
        positions with factor 4, serves 131,072); else `context`."""
        if self.rope_type not in ("linear", "yarn", "dynamic"):
            return context
        return int(self.params.get("original_max_position_embeddings", context)
                   * float(self.params["factor"]))


@dataclass(frozen=True)
class GraniteScales:
    """Granite's constants (config.json's names), each a multiply in transformers'
    forward: the embedding (`embedding_multiplier`), each block's attention and MLP output
    before its residual add (`residual_multiplier`), the attention scores instead of
    1/sqrt(head_dim) (`attention_multiplier`), the logits divided (`logits_scaling`).
    All linear, so they are folded into weights once: Q's rows, o_proj, down_proj, the
    embedding and the final norm (`_fold_granite`), and a LoRA adapter's B of the same modules
    (`lora_output_scales`); the model then runs as a plain Llama."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None  # None: 1/sqrt(head_dim), Llama's
    logits_scaling: float = 1.0

    def q_scale(self, head_dim: int) -> float:
        return 1.0 if self.attention_multiplier is None \
            else self.attention_multiplier * math.sqrt(head_dim)

    def lora_output_scales(self, head_dim: int) -> dict[str, float]:
        """What each PEFT module's output is multiplied by in the folded model."""
        r = self.residual_multiplier
        return {"q_proj": self.q_scale(head_dim), "o_proj": r, "down_proj": r}


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE,
    Granite MoE, OLMoE): a router (`gate`, hidden -> num_experts) scores each token, the
    `top_k` best experts (each a SwiGLU MLP of `intermediate_size`) run on it, and their
    outputs are summed weighted by the softmax of the scores over all experts,
    renormalized over the chosen ones where `norm_topk_prob` (Mixtral and Granite always;
    the Qwens and OLMoE by their config). `dense_layers` keep a plain MLP (Qwen-MoE's
    `mlp_only_layers` and `decoder_sparse_step`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # Qwen2-MoE's shared expert, run on every token beside the chosen ones and scaled by
    # sigmoid(its own gate): its MLP's width, 0 for none
    shared_intermediate_size: int = 0
    # the checkpoint's names: the block (`model.layers.N.<block>.gate`, `.experts.E.`) and
    # each expert's gate, up and down projections (Mixtral: block_sparse_moe, w1, w3, w2);
    # `hf_stacked`: Granite's, all experts in one tensor a projection (`input_linear`,
    # gate|up `[experts, 2 * intermediate, hidden]`; `output_linear`) and `router.layer`
    hf_block: str = "mlp"
    hf_parts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    hf_stacked: bool = False

    def hf_names(self, block: str) -> list[str]:
        """The checkpoint's tensors of one sparse layer (`block`: `model.layers.N.mlp.`)."""
        if self.hf_stacked:
            return [block + n + ".weight" for n in ("router.layer", "input_linear",
                                                      "output_linear")]
        names = [block + "gate.weight"]
        if self.shared_intermediate_size:
            names += [f"{block}shared_expert.{n}.weight" for n in self.hf_parts]
            names.append(block + "shared_expert_gate.weight")
        return names + [f"{block}experts.{e}.{n}.weight" for e in range(self.num_experts)
                        for n in self.hf_parts]

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise InvalidRequestError(f"num_experts_per_tok {self.top_k} must be in "
                                      f"1..{self.num_experts} (the experts)", param="model")


@dataclass(frozen=True)
class BlockNorms:
    """Which norms a block has, by their checkpoint names (`model.layers.N.<name>.weight`;
    "" for none): Llama's normalize each branch's input, OLMo 2's each branch's output,
    Gemma's and GLM-4's both."""

    attention_input: str
    attention_output: str
    mlp_input: str
    mlp_output: str

    def __post_init__(self) -> None:
        if (bool(self.attention_input) != bool(self.mlp_input)
                or bool(self.attention_output) != bool(self.mlp_output)):
            raise InvalidRequestError(f"{self}: both branches' input norms or neither, and "
                                      "their output norms likewise", param="model")

    @property
    def names(self) -> list[str]:
        return [n for n in (self.attention_input, self.attention_output, self.mlp_input,
                            self.mlp_output) if n]


BLOCK_NORMS = {
    "llama": BlockNorms("input_layernorm", "", "post_attention_layernorm", ""),
    "gemma": BlockNorms("input_layernorm", "post_attention_layernorm",
                        "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "olmo2": BlockNorms("", "post_attention_layernorm", "", "post_feedforward_layernorm"),
    "glm4": BlockNorms("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                       "post_mlp_layernorm"),
}


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 2's and 3's differences from a Llama (config.json's names in brackets): each block
    normalizes its attention's and its MLP's outputs before their residual adds
    (`post_attention_layernorm`, `post_feedforward_layernorm`; the MLP's input norm is
    `pre_feedforward_layernorm`), the MLP is gated by GELU's tanh form
    (`gelu_pytorch_tanh`), the embedding's rows are multiplied by sqrt(hidden_size), the
    attention scores scaled by 1/sqrt(`query_pre_attn_scalar`), and some layers attend
    through a sliding window (`LlamaConfig.sliding_window`: Gemma 3's with their own RoPE,
    `rope_local_base_freq`; Gemma 2's with the global one). Every RMSNorm multiplies by
    (1 + weight): folded into the weights at load (`_fold_gemma`), as is the score scale
    (into Q's head norm, Gemma 3; Q's rows, Gemma 2), so the norms and kernels are
    Llama's. Gemma 2 caps the attention scores at
    `attn_softcap * tanh(s / attn_softcap)` (`attn_logit_softcapping`) and the logits
    likewise (`final_logit_softcapping`)."""

    query_pre_attn_scalar: float = 256.0
    attn_softcap: float | None = None
    final_softcap: float | None = None

    def lora_output_scales(self, cfg: LlamaConfig) -> dict[str, float]:
        """What a PEFT module's output is multiplied by in the folded model: Q's, where
        the score scale went into Q's rows (Gemma 2; 1 but for 27B's 144 against 128)."""
        if cfg.qk_norm:
            return {}
        return {"q_proj": math.sqrt(cfg.head_dim / self.query_pre_attn_scalar)}


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters, from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    # the part of each head RoPE rotates (Phi-4-mini's 0.75; the rest passes unrotated)
    partial_rotary_factor: float = 1.0
    # GLM: RoPE rotates adjacent pairs (GPT-J's style), not halves: Q's and K's rows are
    # reordered at load so that the half-split rotation computes the same (_deinterleave)
    rope_interleaved: bool = False
    qkv_bias: bool = False
    # a bias on the attention's output projection too: `attention_bias` of Llama, Granite,
    # Qwen3 (Qwen2's bias is on Q/K/V only)
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each Q and each K head (its own weights)
    # OLMoE, OLMo 2 and 3: one RMSNorm over all of Q's heads, one over K's
    qk_norm_whole: bool = False
    # each block's norms, by their checkpoint names: its attention's input and output, its
    # MLP's input and output ("" where there is none; BLOCK_NORMS's)
    block_norms: BlockNorms = field(default_factory=lambda: BLOCK_NORMS["llama"])
    # SmolLM3's per layer: 1 rotates Q and K, 0 does not (NoPE); empty: every layer rotates
    no_rope_layers: tuple[int, ...] = ()
    granite: GraniteScales | None = None  # Granite's multipliers (folded into weights)
    moe: MoEConfig | None = None  # experts in place of the MLP (Mixtral, Qwen3-MoE, ...)
    gemma: GemmaConfig | None = None  # Gemma's norms, GELU, score scale, soft caps
    # layers that attend only to the `sliding_window` tokens ending at each query (Gemma's
    # local layers, OLMo 3's): 1 in `sliding_layers`; rotated by `local_rope` where it is
    # not None (Gemma 3's own RoPE base; OLMo 3's unscaled RoPE beside global YaRN)
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    local_rope: RopeConfig | None = None
    tie_word_embeddings: bool = False
    mlp_activation: str = "silu"  # MLP_ACTIVATIONS': Gemma's gelu_tanh, Arcee's relu2
    # an embedding model trained to be cut (Matryoshka): the sizes `dimensions` may take
    # (() any); None: not such a model, `dimensions` refused (vLLM's rule)
    matryoshka_dimensions: tuple[int, ...] | None = None
    # a `*ForSequenceClassification` checkpoint's label names (id2label, in id order): its
    # `score` head reads the last token's state (ModelRunner.classifier); () for others
    labels: tuple[str, ...] = ()
    multi_label: bool = False  # each label's own sigmoid (else a softmax over them)
    # every token attends to its whole input (EmbeddingGemma), and a sliding layer to the
    # tokens less than `sliding_window` away on either side: an embedding model, run as
    # an encoder (whole inputs a step; sluice.engine.attention's bidirectional layout)
    bidirectional: bool = False

    def uses_rope(self, layer: int) -> bool:
        return not self.no_rope_layers or bool(self.no_rope_layers[layer])

    def window(self, layer: int) -> int | None:
        """The sliding window `layer` attends through, or None."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError("num_attention_heads must be a multiple of "
                                      "num_key_value_heads", param="model")
        if self.sliding_layers and (len(self.sliding_layers) != self.num_layers
                                    or self.sliding_window is None):
            raise InvalidRequestError(f"{len(self.sliding_layers)} sliding-layer flags for "
                                      f"{self.num_layers} layers (window "
                                      f"{self.sliding_window})", param="model")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise InvalidRequestError(f"unsupported MLP activation {self.mlp_activation!r} "
                                      f"{MLP_ACTIVATIONS}", param="model")
        if not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise InvalidRequestError(f"partial_rotary_factor {self.partial_rotary_factor} "
                                      f"rotates {self.rotary_dim} of {self.head_dim} dimensions "
                                      "a head (an even number, at least 2)", param="model")

    @property
    def rotary_dim(self) -> int:
        """The rotated width of each head, as transformers rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameters in the matmuls a token goes through (for FLOP accounting): a mixture
        of experts counts its router and the `top_k` experts a token runs, not all."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        total = self.num_layers * attn + self.vocab_size * self.hidden_size
        for layer in range(self.num_layers):
            if self.moe is not None and self.is_sparse(layer):
                moe = self.moe
                total += self.hidden_size * (moe.num_experts + 3 * moe.top_k * moe.intermediate_size)
                if moe.shared_intermediate_size:
                    total += self.hidden_size * (1 + 3 * moe.shared_intermediate_size)
            else:  # gate, up, down (up and down without a gate)
                mats = 2 if self.mlp_activation == "relu2" else 3
                total += mats * self.hidden_size * self.intermediate_size
        return total


# --- RoPE ----------------------------------------------------------------------------------


# Each scaler maps the unscaled frequencies (`base ** -(2i / dim)`, `dim` the rotated
# width) to the scaled ones and the factor cos and sin are multiplied by (transformers'
# `attention_scaling`: YaRN's and longrope's), given the context the tables serve.
RopeScaler = Callable[[Tensor, "RopeConfig", int, int], tuple[Tensor, float]]


def _default_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                         context: int) -> tuple[Tensor, float]:
    return inv_freq, 1.0


def _linear_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                        context: int) -> tuple[Tensor, float]:
    return inv_freq / float(rope.params["factor"]), 1.0


def _dynamic_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                         context: int) -> tuple[Tensor, float]:
    """Dynamic NTK scaling: the base raised for the context served, base * (factor *
    context / original - (factor - 1)) ** (dim / (dim - 2)), unscaled within the original
    context. One choice per served context (as longrope's, `_longrope_frequencies`):
    transformers recomputes it each forward pass from the sequence's length (its cached
    keys keep the old rotation); vLLM fixes it at the original context times the factor,
    which is sluice's default context for such a model, so at the default both agree, and
    with `--max-model-len` within the original transformers does too."""
    if not rope.past_original(context):
        return inv_freq, 1.0
    p = rope.params
    factor, original = float(p["factor"]), float(p["original_max_position_embeddings"])
    base = rope.theta * (factor * context / original - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base ** exponents), 1.0


def _llama3_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                        context: int) -> tuple[Tensor, float]:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    params = rope.params
    factor, low, high = (float(params[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                      context: int) -> tuple[Tensor, float]:
    """YaRN (Qwen2.5/3 past 32K, gpt-oss, Ministral): the frequencies that turn fewer than
    `beta_slow` times over the original context divided by `factor` (interpolated), those
    turning more than `beta_fast` times kept (extrapolated), a linear ramp between; cos
    and sin scaled by 0.1 ln(factor) + 1 (DeepSeek's ratio of two such with `mscale`,
    `mscale_all_dim`), or by `attention_factor` where the config gives one."""
    p = rope.params
    factor, original = float(p["factor"]), float(p["original_max_position_embeddings"])
    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = (_yarn_mscale(factor, float(p["mscale"]))
                         / _yarn_mscale(factor, float(p["mscale_all_dim"])))
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(turns: float) -> float:  # the dimension that turns `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(float(p.get("beta_fast") or 32)), correction_dim(
        float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: extrapolated (the frequency kept), 1: interpolated (divided by factor)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def _longrope_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                          context: int) -> tuple[Tensor, float]:
    """Phi-3/3.5/4-mini's longrope: each frequency divided by its own factor, the
    `short_factor` list for a context within `original_max_position_embeddings`, the
    `long_factor` list past it; cos and sin scaled by sqrt(1 + ln(factor) / ln(original))
    (`factor`: the config's context over the original), or by `attention_factor`.

    Which list is a choice per served context, as llama.cpp makes it (`n_ctx` against
    the original): every position of every sequence rotates one way, so the keys in the
    cache, a prefix shared between requests and a preempted sequence's recomputation
    agree. transformers picks per forward pass (long once the sequence passes the
    original length; its cached keys keep the short rotation), vLLM per batch (long for
    all once any sequence does): with `--max-model-len` at most the original length both
    match sluice exactly; past it a sequence shorter than the original length rotates
    with the long factors here, where theirs use the short ones."""
    p = rope.params
    original = float(p["original_max_position_embeddings"])
    factors = p["long_factor"] if rope.past_original(context) else p["short_factor"]
    if len(factors) != dim // 2:
        raise InvalidRequestError(f"longrope: {len(factors)} factors for {dim // 2} "
                                  "rotated frequencies", param="model")
    attention = p.get("attention_factor")
    if attention is None:
        factor = float(p["factor"])
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / torch.tensor(factors, dtype=torch.float32), float(attention)


def _gguf_factor_frequencies(inv_freq: Tensor, rope: RopeConfig, dim: int,
                             context: int) -> tuple[Tensor, float]:
    """llama.cpp's `rope_freqs` tensor: per-frequency divisors (how GGUF stores llama3)."""
    return inv_freq / torch.as_tensor(rope.params["freq_factors"], dtype=inv_freq.dtype), 1.0


# what each scaling reads from `RopeConfig.params` (the loaders fill what configs leave out)
ROPE_REQUIRED_PARAMS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings"),
    "gguf_freq_factors": ("freq_factors",),
}
ROPE_FREQUENCY_SCALERS: dict[str, RopeScaler] = {
    "default": _default_frequencies,
    "linear": _linear_frequencies,
    "dynamic": _dynamic_frequencies,
    "llama3": _llama3_frequencies,
    "yarn": _yarn_frequencies,
    "longrope": _longrope_frequencies,
    "gguf_freq_factors": _gguf_factor_frequencies,
}


def inv_frequencies(rope: RopeConfig, dim: int, context: int) -> tuple[Tensor, float]:
    """The `dim // 2` rotation frequencies of a `dim`-wide rotation, scaled as
    `rope.rope_type` says for a `context`-token context, and cos and sin's factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return ROPE_FREQUENCY_SCALERS[rope.rope_type](1.0 / (rope.theta ** exponents), rope, dim,
                                                  context)


def rope_tables(rope: RopeConfig, dim: int, max_positions: int) -> tuple[Tensor, Tensor]:
    """cos and signed sin `[max_positions, dim]`, float32, for `apply_rope`; `dim` is the
    rotated part of each head (all of it but for Phi-4-mini's 3/4, `LlamaConfig.rotary_dim`).

    Hugging Face's rotation is `x*cos + rotate_half(x)*sin` with
    `rotate_half(x) = cat(-x2, x1)`; folding the minus sign into the sin table
    (`cat(-sin, sin)`) leaves a swap of the halves, one multiply and one fused add.
    """
    inv_freq, scale = inv_frequencies(rope, dim, max_positions)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x `[T, heads, head_dim]`, tables `[T, 1, dim]`: rotate each half-split pair of the
    first `dim` of each head (all of it but for a partial rotation), keep the rest."""
    t, heads, d = x.shape
    if cos.shape[-1] < d:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, signed_sin), x[..., r:]), -1)
    swapped = x.reshape(t, heads, 2, d // 2).flip(2).reshape(t, heads, d)
    return torch.addcmul(x * cos, swapped, signed_sin)


# --- the model -----------------------------------------------------------------------------


class Linear(nn.Module):
    """`y = x @ weight.T + bias`, nn.Linear's layout; `matmul` is the implementation the
    runner picked (oneDNN's on CPU, see `sluice.engine.native.cpu_linear`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.matmul: LinearKernel = F.linear
        # adds the step's LoRA deltas to the output in place (sluice.engine.lora), or None
        self.lora: Callable[[Tensor, Tensor], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        y = self.matmul(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora(x, y)
        return y


class SoftcappedHead(Linear):
    """Gemma 2's output head: logits capped at `cap * tanh(logits / cap)`."""

    def __init__(self, in_features: int, out_features: int, cap: float) -> None:
        super().__init__(in_features, out_features)
        self.cap = cap

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(super().forward(x) / self.cap) * self.cap


class Embedding(nn.Module):
    """Token id -> row of `weight` (nn.Embedding's layout). Not nn.Embedding: its random
    init, even on the meta device, goes through torch's reference ops, whose first use
    imports torch._dynamo (~3 s of a start)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, use_rope: bool = True, window: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.use_rope = use_rope  # False: a NoPE layer (SmolLM3's every fourth)
        self.window = window  # a sliding window's length (Gemma's and OLMo 3's local layers)
        self.softcap = cfg.gemma.attn_softcap if cfg.gemma is not None else None
        self.wqkv = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3: each head of Q and of K normalized before RoPE, one weight [head_dim] each;
        # OLMoE: Q's heads together and K's, weights [q_size] and [kv_size]
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm_whole:
            self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)
        self.kv_cache: KVCache | None = None
        self.rope: RopeKernel | None = None  # native RoPE in place, set by the runner

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, meta: AttentionMetadata) -> Tensor:
        cfg, t = self.cfg, x.shape[0]
        qkv = self.wqkv(x)
        # Q and K heads rotate together: one RoPE over [T, heads + kv_heads, head_dim]
        qk = qkv[:, :cfg.q_size + cfg.kv_size].view(t, -1, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # a new tensor, contiguous
            q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
            if cfg.qk_norm_whole:
                q = self.q_norm(q.reshape(t, cfg.q_size)).view(q.shape)
                k = self.k_norm(k.reshape(t, cfg.kv_size)).view(k.shape)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            qk = torch.cat((q, k), 1)
        if self.use_rope and self.rope is not None:  # in place: qkv (or the normed qk)
            self.rope(qk, cos, sin)  # is this step's own
        elif self.use_rope:
            qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(t, cfg.num_kv_heads, cfg.head_dim)
        assert self.kv_cache is not None, "KV cache not allocated"
        return self.wo(paged_attention(q, k, v, self.kv_cache, meta, self.window, self.softcap))


# an MLP's activation (LlamaConfig.mlp_activation): SwiGLU, silu(gate) * up (the native
# kernels' and the decode graph's); Gemma's gelu_tanh(gate) * up; Arcee's relu(up)² with no
# gate
MLP_ACTIVATIONS = ("silu", "gelu_tanh", "relu2")


class FeedForward(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 activation: str = "silu") -> None:
        super().__init__()
        self.activation = activation  # one of MLP_ACTIVATIONS
        gated = activation != "relu2"
        self.w13 = Linear(hidden_size, (2 if gated else 1) * intermediate_size)  # gate|up, or up
        self.w2 = Linear(intermediate_size, hidden_size)
        self.fused: ActivationKernel | None = None  # native silu(gate) * up, set by the runner
        # the whole silu(x @ gate.T) * (x @ up.T) (native.PackedSwiGLU), set by the runner
        self.swiglu: PackedSwiGLU | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.activation == "relu2":
            return self.w2(F.relu(self.w13(x)).square())
        if self.activation == "gelu_tanh":
            gate, up = self.w13(x).chunk(2, dim=-1)
            return self.w2(F.gelu(gate, approximate="tanh") * up)
        fused = self.swiglu
        if (fused is not None and x.shape[0] >= fused.min_rows and x.dtype == fused.dtype
                and self.w13.matmul is fused.packed and self.w13.lora is None):
            return self.w2(fused(x))
        gate_up = self.w13(x)
        if self.fused is not None and gate_up.is_contiguous():
            return self.w2(self.fused(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Router(Linear):
    """A mixture of experts' gate (hidden -> one score per expert): a Linear that stays in
    the model's float dtype when the others are quantized, as vLLM keeps it (an int8
    router would pick other experts than the checkpoint's)."""


class SparseMoE(nn.Module):
    """Experts in place of the MLP (`MoEConfig`): each token runs through its `top_k`
    experts, chosen and weighted by the router, as transformers' Mixtral and Qwen3-MoE
    compute it (softmax in float32, top-k, renormalized, cast back). The step's tokens are
    grouped by expert (one stable sort of the choices), so each chosen expert does one
    matmul of its tokens' rows, and its weighted outputs are added back into their rows;
    an expert no token chose costs nothing."""

    def __init__(self, cfg: LlamaConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        self.experts = nn.ModuleList(FeedForward(cfg.hidden_size, moe.intermediate_size)
                                     for _ in range(moe.num_experts))
        self.shared_expert: FeedForward | None = None  # Qwen2-MoE's, and its gate
        self.shared_gate: Router | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = FeedForward(cfg.hidden_size, moe.shared_intermediate_size)
            self.shared_gate = Router(cfg.hidden_size, 1)

    def forward(self, x: Tensor) -> Tensor:
        k = self.moe.top_k
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)  # [T, k] each
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        choices = chosen.flatten()  # choice c is token c // k's
        order = choices.argsort(stable=True)
        counts = torch.bincount(choices, minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                picked = order[start:start + n]
                rows = picked // k
                y = self.experts[expert](x[rows])
                out.index_add_(0, rows, y * weights[picked].unsqueeze(1))
                start += n
        if self.shared_expert is not None and self.shared_gate is not None:
            out += torch.sigmoid(self.shared_gate(x)) * self.shared_expert(x)
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused: AddNormKernel | None = None  # native add + norm, set by the runner

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """`residual + x` and its norm: `(norm(residual + x), residual + x)`.

        The native kernel works in place (x becomes the norm, residual the sum): both are
        the step's own intermediate tensors, which nothing else holds.
        """
        if self.fused is not None and x.is_contiguous() and residual.is_contiguous():
            self.fused(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self(residual), residual


class ResidualAdd(nn.Module):
    """In place of a branch's input norm where a block has none (OLMo 2): `add` is the
    residual add alone, its sum both the branch's input and the residual."""

    def forward(self, x: Tensor) -> Tensor:
        return x

    def add(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        total = residual + x
        return total, total


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        norms = cfg.block_norms
        self.attention_norm: RMSNorm | ResidualAdd = ResidualAdd()
        self.ffn_norm: RMSNorm | ResidualAdd = ResidualAdd()
        if norms.attention_input:  # (both input norms or neither: BlockNorms)
            self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg, cfg.uses_rope(layer), cfg.window(layer))
        self.feed_forward: FeedForward | SparseMoE = (
            SparseMoE(cfg, cfg.moe) if cfg.moe is not None and cfg.is_sparse(layer)
            else FeedForward(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_activation))
        # Gemma's, OLMo 2's and GLM-4's norms of each branch's output, before its residual add
        self.post_attention_norm: RMSNorm | None = None
        self.post_ffn_norm: RMSNorm | None = None
        if norms.attention_output:
            self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor,
                meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """`(x, residual)` -> `(x, residual)`; their sum is the block's output."""
        if residual is None:  # the first block: its input is the embedding
            x, residual = self.attention_norm(x), x
        else:
            x, residual = self.attention_norm.add(x, residual)
        x = self.attention(x, cos, sin, meta)
        if self.post_attention_norm is not None:
            x = self.post_attention_norm(x)
        x, residual = self.ffn_norm.add(x, residual)
        x = self.feed_forward(x)
        if self.post_ffn_norm is not None:
            x = self.post_ffn_norm(x)
        return x, residual


class Transformer(nn.Module):
    """Token ids `[T]` (all of a step's sequences, flattened) -> logits of selected rows."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        cap = cfg.gemma.final_softcap if cfg.gemma is not None else None
        self.output = (Linear(cfg.hidden_size, cfg.vocab_size) if cap is None
                       else SoftcappedHead(cfg.hidden_size, cfg.vocab_size, cap))
        self.rope_cos: Tensor | None = None
        self.rope_sin: Tensor | None = None
        # the sliding layers' own tables (Gemma 3's, OLMo 3's); None: the global ones
        self.local_rope: tuple[Tensor, Tensor] | None = None

    def init_rope(self, max_positions: int) -> None:
        """Precompute cos/sin for positions `0..max_positions-1` on the weights' device/dtype."""
        w = self.output.weight
        cos, sin = rope_tables(self.cfg.rope, self.cfg.rotary_dim, max_positions)
        self.rope_cos, self.rope_sin = cos.to(w.device, w.dtype), sin.to(w.device, w.dtype)
        local = self.cfg.local_rope
        if local is not None and local != self.cfg.rope:
            cos, sin = rope_tables(local, self.cfg.rotary_dim, max_positions)
            self.local_rope = cos.to(w.device, w.dtype), sin.to(w.device, w.dtype)

    def forward(self, tokens: Tensor, positions: Tensor, meta: AttentionMetadata,
                logits_index: Tensor) -> Tensor:
        """The logits of the `logits_index` rows."""
        return self.output(self.hidden(tokens, positions, meta, logits_index))

    def hidden(self, tokens: Tensor, positions: Tensor, meta: AttentionMetadata,
               index: Tensor) -> Tensor:
        """The final hidden states (after the last norm: what the LM head reads, and an
        embedding model's output) of the `index` rows."""
        assert self.rope_cos is not None and self.rope_sin is not None, "call init_rope first"
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        local = cos, sin
        if self.local_rope is not None:
            lcos, lsin = self.local_rope
            local = lcos[positions].unsqueeze(1), lsin[positions].unsqueeze(1)
        x, residual = self.embed(tokens), None
        for i, layer in enumerate(self.layers):
            lcos, lsin = local if self.cfg.window(i) is not None else (cos, sin)
            x, residual = layer(x, residual, lcos, lsin, meta)
        assert residual is not None, "a model has at least one layer"
        x, _ = self.norm.add(x[index], residual[index])
        return x

    def embed(self, tokens: Tensor) -> Tensor:
        """The tokens' rows as the first block takes them: the embeddings, Gemma's times
        sqrt(hidden) rounded to the dtype as Gemma does."""
        x = self.tok_embeddings(tokens)
        if self.cfg.gemma is not None:
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        return x

    def use_fused_kernels(self, add_norm: AddNormKernel, activation: ActivationKernel,
                          rope: RopeKernel | None = None) -> None:
        """Route every residual add + RMSNorm, every SwiGLU activation and (given) every
        RoPE through the native kernels (the runner's choice)."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.fused = add_norm
            elif isinstance(module, FeedForward):
                module.fused = activation
            elif isinstance(module, Attention):
                module.rope = rope

    def use_linear(self, kernel: LinearKernel) -> None:
        """Run every matmul through `kernel` (the runner's choice)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.matmul = kernel


def fuse_hf_weights(cfg: LlamaConfig, hf: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Hugging Face parameter names -> this model's (Q|K|V and gate|up concatenated)."""
    out = {"tok_embeddings.weight": hf["model.embed_tokens.weight"],
           "norm.weight": hf["model.norm.weight"],
           "output.weight": hf["model.embed_tokens.weight"] if cfg.tie_word_embeddings
           else hf["lm_head.weight"]}
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        out[a + "attention.wqkv.weight"] = torch.cat(
            [hf[attn + f"{n}_proj.weight"] for n in "qkv"])
        if cfg.qkv_bias:
            out[a + "attention.wqkv.bias"] = torch.cat([hf[attn + f"{n}_proj.bias"] for n in "qkv"])
        out[a + "attention.wo.weight"] = hf[attn + "o_proj.weight"]
        if cfg.o_bias:
            out[a + "attention.wo.bias"] = hf[attn + "o_proj.bias"]
        if cfg.qk_norm or cfg.qk_norm_whole:
            out[a + "attention.q_norm.weight"] = hf[attn + "q_norm.weight"]
            out[a + "attention.k_norm.weight"] = hf[attn + "k_norm.weight"]
        if cfg.moe is not None and cfg.is_sparse(i):
            _fuse_experts(cfg.moe, hf, p + cfg.moe.hf_block + ".", a + "feed_forward.", out)
        elif cfg.mlp_activation == "relu2":  # no gate: w13 is up alone
            out[a + "feed_forward.w13.weight"] = hf[p + "mlp.up_proj.weight"]
            out[a + "feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
        else:
            _fuse_mlp(hf, p + "mlp.", ("gate_proj", "up_proj", "down_proj"),
                      a + "feed_forward.", out)
        norms = cfg.block_norms
        for ours, theirs in (("attention_norm", norms.attention_input),
                             ("post_attention_norm", norms.attention_output),
                             ("ffn_norm", norms.mlp_input), ("post_ffn_norm", norms.mlp_output)):
            if theirs:
                out[f"{a}{ours}.weight"] = hf[f"{p}{theirs}.weight"]
    if cfg.granite is not None:
        _fold_granite(cfg, cfg.granite, out)
    if cfg.gemma is not None:
        _fold_gemma(cfg, cfg.gemma, out)
    if cfg.rope_interleaved:
        _deinterleave(cfg, out)
    return out


def _fold_gemma(cfg: LlamaConfig, g: GemmaConfig, out: dict[str, Tensor]) -> None:
    """Gemma's RMSNorms multiply by (1 + weight): every norm's weight becomes 1 + weight
    (in float32, new tensors); its scores' 1/sqrt(query_pre_attn_scalar) replaces the
    attention's 1/sqrt(head_dim) through Q's head norm where there is one (Gemma 3; RoPE
    is linear, so the scale passes through it), else Q's rows (Gemma 2)."""
    q_scale = math.sqrt(cfg.head_dim / g.query_pre_attn_scalar)
    for name in [n for n in out if n.endswith("norm.weight")]:
        out[name] = out[name].float() + 1.0
        if name.endswith("attention.q_norm.weight"):
            out[name] = out[name] * q_scale
    if not cfg.qk_norm:
        _scale_q_rows(cfg, q_scale, out)


def _deinterleave(cfg: LlamaConfig, out: dict[str, Tensor]) -> None:
    """GLM rotates adjacent pairs of each head's first `rotary_dim` dimensions, (x0, x1),
    (x2, x3), ..., pair i at frequency i; this model rotates (x_i, x_{i + r/2}). So each
    Q and K head's rotated rows of the fused Q|K|V weight and bias are reordered, the
    even ones first, then the odd ones (new tensors): the half-split rotation of the
    reordered head is GLM's rotation of the original, reordered, and q·k is unchanged,
    Q and K reordered alike. V and the unrotated rows stay."""
    qk_heads = cfg.num_heads + cfg.num_kv_heads
    rows = torch.cat([_rotary_rows(cfg, qk_heads),
                      torch.arange(qk_heads * cfg.head_dim, cfg.q_size + 2 * cfg.kv_size)])
    for i in range(cfg.num_layers):
        for name in (f"layers.{i}.attention.wqkv.weight", f"layers.{i}.attention.wqkv.bias"):
            if name in out:
                out[name] = out[name][rows]


def _rotary_rows(cfg: LlamaConfig, heads: int) -> Tensor:
    """`_deinterleave`'s order of the rows of `heads` heads: each head's rotated rows,
    the even ones first, then the odd ones, then its unrotated rows."""
    r, d = cfg.rotary_dim, cfg.head_dim
    head = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
    return torch.cat([h * d + head for h in range(heads)])


def lora_output_rows(cfg: LlamaConfig) -> dict[str, Tensor]:
    """The order a LoRA adapter's B rows take where the model reordered its weights' rows
    at load (`load_adapter`'s `output_rows`): q_proj's and k_proj's as `_deinterleave`
    reordered the fused Q|K|V's (GLM, Helium); none elsewhere."""
    if not cfg.rope_interleaved:
        return {}
    return {"q_proj": _rotary_rows(cfg, cfg.num_heads),
            "k_proj": _rotary_rows(cfg, cfg.num_kv_heads)}


def _scale_q_rows(cfg: LlamaConfig, scale: float, out: dict[str, Tensor]) -> None:
    """Q's rows of every fused Q|K|V weight and bias multiplied by `scale` (new tensors):
    a multiplier of the attention scores folded into the weights."""
    for i in range(cfg.num_layers):
        for name in (f"layers.{i}.attention.wqkv.weight", f"layers.{i}.attention.wqkv.bias"):
            if name in out:
                scaled = out[name].clone()
                scaled[:cfg.q_size] *= scale
                out[name] = scaled


def _fuse_mlp(hf: Mapping[str, Tensor], source: str, parts: tuple[str, str, str],
              target: str, out: dict[str, Tensor]) -> None:
    """One SwiGLU MLP's checkpoint projections (`source` + gate, up, down `parts`) as
    this model's `target` + `w13` (gate|up concatenated) and `w2`."""
    gate, up, down = (hf[f"{source}{part}.weight"] for part in parts)
    out[target + "w13.weight"] = torch.cat([gate, up])
    out[target + "w2.weight"] = down


def _fuse_experts(moe: MoEConfig, hf: Mapping[str, Tensor], block: str, prefix: str,
                  out: dict[str, Tensor]) -> None:
    """One sparse layer's router and experts (gate|up fused, as a dense MLP's are) under
    this model's names (`prefix`: `layers.N.feed_forward.`)."""
    if moe.hf_stacked:  # Granite: gate|up already fused, every expert in one tensor
        out[prefix + "gate.weight"] = hf[block + "router.layer.weight"]
        w13, w2 = hf[block + "input_linear.weight"], hf[block + "output_linear.weight"]
        for e in range(moe.num_experts):
            out[f"{prefix}experts.{e}.w13.weight"] = w13[e]
            out[f"{prefix}experts.{e}.w2.weight"] = w2[e]
        return
    out[prefix + "gate.weight"] = hf[block + "gate.weight"]
    if moe.shared_intermediate_size:
        _fuse_mlp(hf, block + "shared_expert.", moe.hf_parts, prefix + "shared_expert.", out)
        out[prefix + "shared_gate.weight"] = hf[block + "shared_expert_gate.weight"]
    for e in range(moe.num_experts):
        _fuse_mlp(hf, f"{block}experts.{e}.", moe.hf_parts, f"{prefix}experts.{e}.", out)


def _fold_granite(cfg: LlamaConfig, g: GraniteScales, out: dict[str, Tensor]) -> None:
    """Granite's multipliers into the fused weights (new tensors; `out` is rebound):
    scores q·k * attention_multiplier = (q * attention_multiplier * sqrt(d))·k / sqrt(d);
    residual + branch * r = residual + (o_proj or down_proj scaled by r)(x); the
    embedding times its multiplier, and logits / logits_scaling (a tied head reads the
    scaled embedding, so divided by its multiplier too) as the final norm's weight
    divided, which scales the head's input."""
    _scale_q_rows(cfg, g.q_scale(cfg.head_dim), out)
    # each branch's output projection: o_proj (and its bias), every down_proj (a dense
    # MLP's or each expert's)
    for name in [n for n in out if n.startswith("layers.") and n.endswith(
            ("attention.wo.weight", "attention.wo.bias", "w2.weight"))]:
        out[name] = out[name] * g.residual_multiplier
    embedding = out["tok_embeddings.weight"] * g.embedding_multiplier
    out["tok_embeddings.weight"] = embedding
    head_scale = g.logits_scaling
    if cfg.tie_word_embeddings:
        out["output.weight"] = embedding
        head_scale *= g.embedding_multiplier
    out["norm.weight"] = out["norm.weight"] / head_scale


def expected_hf_names(cfg: LlamaConfig) -> list[str]:
    """Every Hugging Face tensor name `fuse_hf_weights` reads (to name a missing one)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"] if cfg.qkv_bias else []
        names += [p + "self_attn.o_proj.bias"] if cfg.o_bias else []
        names += ([p + f"self_attn.{n}_norm.weight" for n in "qk"]
                  if cfg.qk_norm or cfg.qk_norm_whole else [])
        if cfg.moe is not None and cfg.is_sparse(i):
            names += cfg.moe.hf_names(p + cfg.moe.hf_block + ".")
        else:
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")
                      if n != "gate" or cfg.mlp_activation != "relu2"]
        names += [f"{p}{name}.weight" for name in cfg.block_norms.names]
    return names


def build_model(cfg: LlamaConfig, hf_weights: Mapping[str, Tensor], device: torch.device,
                dtype: torch.dtype) -> Transformer:
    """The model from Hugging Face tensors: fused and cast (`model_state`), then assigned."""
    return assemble_model(cfg, model_state(cfg, hf_weights, dtype), device)


def model_state(cfg: LlamaConfig, hf_weights: Mapping[str, Tensor],
                dtype: torch.dtype) -> dict[str, Tensor]:
    """This model's parameters, fused (Q|K|V, gate|up), in `dtype`, contiguous, where the
    inputs are; a tied output head is left out (it is the embedding). What the GGUF
    weights cache stores."""
    missing = [n for n in expected_hf_names(cfg) if n not in hf_weights]
    if missing:
        raise InvalidRequestError(f"checkpoint is missing tensor {missing[0]!r} "
                                  f"({len(missing)} missing)", param="model")
    state = {k: v.to(dtype=dtype).contiguous() for k, v in fuse_hf_weights(cfg, hf_weights).items()}
    if cfg.tie_word_embeddings:
        del state["output.weight"]
    return state


def assemble_model(cfg: LlamaConfig, state: Mapping[str, Tensor],
                   device: torch.device) -> Transformer:
    """Instantiate without allocating (meta device), then assign `model_state`'s tensors,
    moved to `device` (not copied where they already are: memory-mapped ones stay so)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    params = {k: v.to(device) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        params["output.weight"] = params["tok_embeddings.weight"]
    model.load_state_dict(params, assign=True, strict=True)
    return model.eval().requires_grad_(False)
