"""Load a llama.cpp GGUF file: metadata -> LlamaConfig, tensors dequantized to the engine dtype.

Three llama.cpp conventions are undone here so the model file sees Hugging Face weights:

1. Names: `blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (GGUF_NAMES;
   Gemma's and Phi-3's own where they differ, GGUF_NAMES_BY_ARCH).
2. Llama's Q and K rows: llama.cpp's converter interleaves each head's two RoPE halves
   (`reshape(heads, 2, d/2, in).swapaxes(1, 2)`) for its rotate-adjacent-pairs kernel;
   `unpermute_qk` swaps them back for the half-split RoPE here, as transformers'
   GGUF loader does (Granite's and SmolLM3's converters are Llama's: permuted too). Qwen2,
   Qwen3, Gemma and Phi-3 files are not permuted.
3. Gemma's norms: its converter stores each RMSNorm's weight with Gemma's 1 added
   (llama.cpp multiplies by the weight as stored); taken off again here, as transformers'
   GGUF loader does, so the model file folds it back like a checkpoint's.

A mixture of experts (`qwen2moe`, `qwen3moe`, or a `llama` file with `expert_count`:
Mixtral) stores
each projection of all experts as one `[experts, out, in]` tensor; `expert_weights`
splits them into the checkpoint's per-expert names.

Quantized tensors (Q4_0/Q4_1/Q8_0/K-quants...) are dequantized with
`gguf.quants.dequantize`; weights are kept dense in the engine dtype. The model's
state (fused, cast) is cached on disk (`weights_cache`), so a second start of the same
file memory-maps it instead of converting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sluice.engine.models.gguf_file import GGUFFile, read_gguf
from sluice.engine.models.llama import (
    BLOCK_NORMS,
    GemmaConfig,
    GraniteScales,
    LlamaConfig,
    MoEConfig,
    RopeConfig,
    Transformer,
    assemble_model,
    model_state,
)
from sluice.engine.models.loader import ARCHITECTURES, MLP_ACTIVATION_OF, split_fused_weights
from sluice.engine.models.weights_cache import cached_state
from sluice.protocol.errors import InvalidRequestError

# GGUF general.architecture -> (HF architecture, Q/K permuted by llama.cpp, qkv bias,
# Q/K head norms); a `llama` file with experts is a Mixtral (`MixtralForCausalLM`)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool, bool, bool]] = {
    "llama": ("LlamaForCausalLM", True, False, False),
    "mistral": ("MistralForCausalLM", True, False, False),
    "qwen2": ("Qwen2ForCausalLM", False, True, False),
    "qwen3": ("Qwen3ForCausalLM", False, False, True),
    "qwen2moe": ("Qwen2MoeForCausalLM", False, True, False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False, False, True),
    "gemma2": ("Gemma2ForCausalLM", False, False, False),
    "gemma3": ("Gemma3ForCausalLM", False, False, True),
    "phi3": ("Phi3ForCausalLM", False, False, False),
    "granite": ("GraniteForCausalLM", True, False, False),
    "granitemoe": ("GraniteMoeForCausalLM", True, False, False),
    "smollm3": ("SmolLM3ForCausalLM", True, False, False),
    "arcee": ("ArceeForCausalLM", True, False, False),  # no ffn_gate: relu(up)²
    "olmo2": ("Olmo2ForCausalLM", False, False, False),  # its whole-Q/K norms: ArchSpec's
    # (OLMo 3's files are olmo2 files with a sliding window)
    "exaone4": ("Exaone4ForCausalLM", False, False, True),
    "olmoe": ("OlmoeForCausalLM", False, False, False),  # its whole-Q/K norms: ArchSpec's
    # GLM-4-0414: Q/K rows as the checkpoint's (llama.cpp rotates GLM's adjacent pairs);
    # its Q/K/V bias where the file has one
    "glm4": ("Glm4ForCausalLM", False, False, False),
}
# SmolLM3's layers without RoPE: every fourth, as llama.cpp fixes it (no metadata key)
SMOLLM3_NO_ROPE_STEP = 4
# a mixture of experts' stacked tensors ([experts, out, in]) -> the expert's projection
# (gate, up, down: an index into MoEConfig.hf_parts)
GGUF_EXPERT_PARTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# Qwen2-MoE's shared expert's projections (one expert's, [out, in])
GGUF_SHARED_PARTS = {"ffn_gate_shexp": 0, "ffn_up_shexp": 1, "ffn_down_shexp": 2}

GGUF_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3's block: `ffn_norm` is the MLP's input norm, and a norm after each branch
GGUF_GEMMA_NAMES: dict[str, str] = {
    **GGUF_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GLM-4-0414's block: gate|up fused (`ffn_up`), `ffn_norm` the MLP's input norm, a norm
# after each branch with its own checkpoint names
GGUF_GLM4_NAMES: dict[str, str] = {
    **GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
    "ffn_norm": "post_attention_layernorm", "post_attention_norm": "post_self_attn_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
}
# Phi-3's fused projections (Q|K|V, gate|up), split by `loader.split_fused_weights`
GGUF_PHI3_NAMES: dict[str, str] = {
    **GGUF_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj",
}
# the names of an architecture's file where they differ from Llama's (OLMo 2's and EXAONE
# 4's branch output norms are named as Gemma's; they have no input norms)
GGUF_NAMES_BY_ARCH = {"Gemma2ForCausalLM": GGUF_GEMMA_NAMES, "Gemma3ForCausalLM": GGUF_GEMMA_NAMES,
                      "Olmo2ForCausalLM": GGUF_GEMMA_NAMES, "Exaone4ForCausalLM": GGUF_GEMMA_NAMES,
                      "Glm4ForCausalLM": GGUF_GLM4_NAMES, "Phi3ForCausalLM": GGUF_PHI3_NAMES}
GGUF_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}


def load_gguf_model(path: Path, device: torch.device,
                    dtype: torch.dtype) -> tuple[Transformer, LlamaConfig]:
    gguf = read_gguf(path)
    cfg, permuted = config_from_gguf(gguf)
    state = cached_state(path, dtype,
                         lambda: model_state(cfg, convert_weights(gguf, cfg, permuted), dtype))
    return assemble_model(cfg, state, device), cfg


def convert_weights(gguf: GGUFFile, cfg: LlamaConfig, permuted: bool) -> dict[str, Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, Q/K un-permuted."""
    names = GGUF_NAMES_BY_ARCH.get(cfg.architecture, GGUF_NAMES)
    weights = {hf_name(name, names): dequantize(gguf, name) for name in gguf.tensors
               if name != "rope_freqs.weight"}
    weights = split_fused_weights(cfg, weights)
    if cfg.gemma is not None:  # the converter's 1 added to every norm (see above)
        weights = {name: w - 1.0 if name.endswith("norm.weight") else w
                   for name, w in weights.items()}
    if cfg.moe is not None:
        weights = expert_weights(cfg.moe, weights)
    if permuted:
        for i in range(cfg.num_layers):
            attn = f"model.layers.{i}.self_attn."
            weights[attn + "q_proj.weight"] = unpermute_qk(weights[attn + "q_proj.weight"],
                                                           cfg.num_heads)
            weights[attn + "k_proj.weight"] = unpermute_qk(weights[attn + "k_proj.weight"],
                                                           cfg.num_kv_heads)
    return weights


def expert_weights(moe: MoEConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """llama.cpp's experts, one tensor `blk.N.ffn_gate_exps` `[experts, out, in]` per
    projection and a router `blk.N.ffn_gate_inp`, under the checkpoint's names: one
    tensor per expert (views, no copy) and `<block>.gate`."""
    out = {}
    for name, tensor in weights.items():
        parts = name.split(".")  # blk.N.<kind>.weight (not renamed by hf_name)
        if parts[0] != "blk" or len(parts) != 4:
            out[name] = tensor
            continue
        block = f"model.layers.{parts[1]}.{moe.hf_block}."
        if parts[2] == "ffn_gate_inp":
            out[block + "gate.weight"] = tensor
        elif parts[2] in GGUF_EXPERT_PARTS:
            projection = moe.hf_parts[GGUF_EXPERT_PARTS[parts[2]]]
            for e in range(tensor.shape[0]):
                out[f"{block}experts.{e}.{projection}.weight"] = tensor[e]
        elif parts[2] == "ffn_gate_inp_shexp":  # [hidden] -> the gate's one row
            out[block + "shared_expert_gate.weight"] = tensor.reshape(1, -1)
        elif parts[2] in GGUF_SHARED_PARTS:
            projection = moe.hf_parts[GGUF_SHARED_PARTS[parts[2]]]
            out[f"{block}shared_expert.{projection}.weight"] = tensor
        else:
            out[name] = tensor
    return out


def config_from_gguf(gguf: GGUFFile) -> tuple[LlamaConfig, bool]:
    """LlamaConfig from `<arch>.*` metadata, and whether Q/K rows need un-permuting."""
    arch = gguf.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise InvalidRequestError(f"{gguf.path.name}: unsupported GGUF architecture {arch!r} "
                                  f"(supported: {sorted(GGUF_ARCHITECTURES)})", param="model")
    hf_arch, permuted, qkv_bias, qk_norm = GGUF_ARCHITECTURES[arch]
    spec = ARCHITECTURES[hf_arch]
    qkv_bias = qkv_bias or "blk.0.attn_q.bias" in gguf.tensors  # (GLM-4's)

    def meta(key: str, default: Any = None) -> Any:
        value = gguf.get(f"{arch}.{key}", default)
        if value is None:
            raise InvalidRequestError(f"{gguf.path.name}: missing GGUF metadata {arch}.{key}",
                                      param="model")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    vocab = gguf.get(f"{arch}.vocab_size") or len(gguf.get("tokenizer.ggml.tokens", []))
    moe = None
    if int(gguf.get(f"{arch}.expert_count", 0) or 0):  # every layer's MLP is experts
        moe = moe_from_gguf(gguf, arch)
        hf_arch = "MixtralForCausalLM" if arch in ("llama", "mistral") else hf_arch
    elif arch.endswith("moe"):
        raise InvalidRequestError(f"{gguf.path.name}: missing GGUF metadata "
                                  f"{arch}.expert_count", param="model")
    # with experts in every layer no MLP is dense: the experts' width where a file has none
    ffn = (meta("feed_forward_length") if moe is None
           else gguf.get(f"{arch}.feed_forward_length", moe.intermediate_size))
    head_dim = int(meta("attention.key_length", hidden // heads))
    context = int(meta("context_length"))
    rope = rope_from_gguf(gguf, arch, context)
    context = rope.scaled_context(context)  # as for a checkpoint
    rotary = int(gguf.get(f"{arch}.rope.dimension_count", head_dim))  # Phi-4-mini's 96 of 128
    sliding = sliding_from_gguf(gguf, arch, rope) if arch in GGUF_SLIDING_PERIOD else {}
    window = gguf.get(f"{arch}.attention.sliding_window")
    if window and not sliding:  # a window not run caps the context (exact within it)
        context = min(context, int(window))
    cfg = LlamaConfig(
        architecture=hf_arch, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(ffn), num_layers=int(meta("block_count")),
        num_heads=heads, num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=context,
        rope=rope, partial_rotary_factor=rotary / head_dim, qkv_bias=qkv_bias, qk_norm=qk_norm,
        qk_norm_whole=spec.qk_norm_whole, block_norms=BLOCK_NORMS[spec.block_norms],
        rope_interleaved=spec.rope_interleaved, moe=moe,
        mlp_activation=MLP_ACTIVATION_OF[spec.activation],
        gemma=gemma_from_gguf(gguf, arch, head_dim) if arch.startswith("gemma") else None,
        **sliding,
        granite=granite_from_gguf(gguf, arch) if arch.startswith("granite") else None,
        no_rope_layers=tuple(int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(
            int(meta("block_count")))) if arch == "smollm3"
        # EXAONE 4's global layers, where it slides, rotate nothing (as llama.cpp's)
        else sliding["sliding_layers"] if spec.nope_global and sliding else (),
        o_bias="blk.0.attn_output.bias" in gguf.tensors,
        tie_word_embeddings="output.weight" not in gguf.tensors)
    return cfg, permuted


def granite_from_gguf(gguf: GGUFFile, arch: str) -> GraniteScales:
    """Granite's multipliers as llama.cpp's converter names them (`attention.scale`,
    `embedding_scale`, `residual_scale`, `logit_scale`; each absent where the checkpoint
    left it at its default)."""
    attention = gguf.get(f"{arch}.attention.scale")
    return GraniteScales(
        embedding_multiplier=float(gguf.get(f"{arch}.embedding_scale", 1.0)),
        residual_multiplier=float(gguf.get(f"{arch}.residual_scale", 1.0)),
        attention_multiplier=None if attention is None else float(attention),
        logits_scaling=float(gguf.get(f"{arch}.logit_scale", 1.0)))


# the architectures whose files run sliding windows: a global layer every this many
# where the file has no pattern (llama.cpp's defaults)
GGUF_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6, "olmo2": 4, "exaone4": 4}


def sliding_from_gguf(gguf: GGUFFile, arch: str, rope: RopeConfig) -> dict[str, Any]:
    """The sliding layers as llama.cpp reads them (LlamaConfig's fields; none where an
    `olmo2` or `exaone4` file has no window): the window `attention.sliding_window`; the
    layers `attention.sliding_window_pattern` says (a period, every such layer global, or
    a flag a layer), else `GGUF_SLIDING_PERIOD`'s. Their RoPE: Gemma 3's base
    `rope.freq_base_swa`, else 10,000; OLMo 3's (an `olmo2` file's) the global base or
    `rope.freq_base_swa` without the global scaling; Gemma 2's and EXAONE 4's the global
    RoPE."""
    window = gguf.get(f"{arch}.attention.sliding_window")
    if window is None and arch in ("olmo2", "exaone4"):
        return {}
    if window is None:
        raise InvalidRequestError(f"{gguf.path.name}: missing GGUF metadata "
                                  f"{arch}.attention.sliding_window", param="model")
    layers = int(gguf.get(f"{arch}.block_count"))
    pattern = gguf.get(f"{arch}.attention.sliding_window_pattern", GGUF_SLIDING_PERIOD[arch])
    if isinstance(pattern, list):
        sliding = tuple(int(bool(flag)) for flag in pattern)
    else:
        sliding = tuple(int((i + 1) % int(pattern) != 0) for i in range(layers))
    if len(sliding) != layers:
        raise InvalidRequestError(f"{gguf.path.name}: {arch}.attention.sliding_window_pattern "
                                  f"has {len(sliding)} flags for {layers} layers", param="model")
    local = rope
    if arch == "gemma3":
        local = RopeConfig(float(gguf.get(f"{arch}.rope.freq_base_swa", 10000.0)))
    elif arch == "olmo2":
        local = RopeConfig(float(gguf.get(f"{arch}.rope.freq_base_swa", rope.theta)))
    return {"sliding_window": int(window), "sliding_layers": sliding, "local_rope": local}


def gemma_from_gguf(gguf: GGUFFile, arch: str, head_dim: int) -> GemmaConfig:
    """Gemma's score scale as llama.cpp reads a `gemma2` / `gemma3` file: 1/sqrt(head_dim),
    but for the 27B models (Gemma 2's 46 layers, Gemma 3's 62: 1/sqrt(hidden / heads));
    Gemma 2's soft caps."""
    layers = int(gguf.get(f"{arch}.block_count"))
    big = layers == (46 if arch == "gemma2" else 62)
    scalar = head_dim if not big else (int(gguf.get(f"{arch}.embedding_length"))
                                       // int(gguf.get(f"{arch}.attention.head_count")))
    caps = [gguf.get(f"{arch}.{k}_logit_softcapping") for k in ("attn", "final")]
    return GemmaConfig(query_pre_attn_scalar=float(scalar),
                       attn_softcap=None if caps[0] is None else float(caps[0]),
                       final_softcap=None if caps[1] is None else float(caps[1]))


def moe_from_gguf(gguf: GGUFFile, arch: str) -> MoEConfig:
    """`<arch>.expert_count` experts, `expert_used_count` a token, each of
    `expert_feed_forward_length` (the Qwens) or `feed_forward_length` (Mixtral), their
    weights renormalized over the chosen as llama.cpp computes them (all but Qwen2-MoE's
    and OLMoE's; `expert_weights_norm` where a file says), Qwen2-MoE's shared expert of
    `expert_shared_feed_forward_length`; Mixtral's names for a `llama` file and for
    Granite MoE's (its file splits the checkpoint's stacked gate|up per projection)."""
    size = gguf.get(f"{arch}.expert_feed_forward_length") or gguf.get(
        f"{arch}.feed_forward_length")
    if size is None:
        raise InvalidRequestError(f"{gguf.path.name}: missing GGUF metadata "
                                  f"{arch}.expert_feed_forward_length", param="model")
    names: dict[str, Any] = {}
    if arch in ("llama", "mistral", "granitemoe"):  # one tensor an expert, Mixtral's names
        names = {"hf_block": "block_sparse_moe", "hf_parts": ("w1", "w3", "w2")}
    return MoEConfig(num_experts=int(gguf.get(f"{arch}.expert_count")),
                     top_k=int(gguf.get(f"{arch}.expert_used_count", 0) or 0),
                     intermediate_size=int(size),
                     norm_topk_prob=bool(gguf.get(f"{arch}.expert_weights_norm",
                                                  arch not in ("qwen2moe", "olmoe"))),
                     shared_intermediate_size=int(
                         gguf.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0),
                     **names)


def rope_from_gguf(gguf: GGUFFile, arch: str, context: int) -> RopeConfig:
    """RoPE as llama.cpp's converter writes it: Llama 3's scaling as per-frequency divisors
    (`rope_freqs`); Phi-3's longrope as its two factor lists (`rope_factors_long`,
    `rope_factors_short`), the original context and cos and sin's factor
    (`rope.scaling.attn_factor`); YaRN and linear scaling as `rope.scaling.type` with
    its factor (and YaRN's original context and betas)."""
    theta = float(gguf.get(f"{arch}.rope.freq_base", 10000.0))
    original = gguf.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in gguf.tensors:  # llama3-style scaling, stored as divisors
        factors = dequantize(gguf, "rope_freqs.weight").reshape(-1).tolist()
        return RopeConfig(theta, "gguf_freq_factors", {"freq_factors": factors})
    if "rope_factors_long.weight" in gguf.tensors:  # Phi-3's longrope
        if original is None:
            raise InvalidRequestError(f"{gguf.path.name}: missing GGUF metadata "
                                      f"{arch}.rope.scaling.original_context_length",
                                      param="model")
        params: dict[str, Any] = {
            name: dequantize(gguf, f"rope_factors_{name.split('_')[0]}.weight").reshape(-1).tolist()
            for name in ("long_factor", "short_factor")}
        params.update(original_max_position_embeddings=int(original),
                      factor=context / int(original))
        attention = gguf.get(f"{arch}.rope.scaling.attn_factor")
        if attention is not None:
            params["attention_factor"] = float(attention)
        return RopeConfig(theta, "longrope", params)
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeConfig(theta)
    params = {"factor": float(gguf.get(f"{arch}.rope.scaling.factor", 1.0))}
    if kind == "yarn":
        if gguf.get(f"{arch}.rope.scaling.yarn_log_multiplier"):  # DeepSeek's mscale
            raise InvalidRequestError(f"{gguf.path.name}: {arch}.rope.scaling.yarn_log_multiplier "
                                      "is not supported", param="model")
        params["original_max_position_embeddings"] = int(original or context)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):  # (the config's own)
            value = gguf.get(f"{arch}.rope.scaling.{key}")
            if value is not None:
                params[name] = float(value)
    return RopeConfig(theta, kind, params)


def hf_name(gguf_name: str, names: dict[str, str] = GGUF_NAMES) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return gguf_name  # unknown: kept, and reported by build_model only if it was needed


def dequantize(gguf: GGUFFile, name: str) -> Tensor:
    """One tensor as float32, in numpy (rows-first) shape."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    info = gguf.tensors[name]
    array = gguf_dequantize(gguf.raw(name), GGMLQuantizationType(info.ggml_type))
    array = np.ascontiguousarray(array, dtype=np.float32).reshape(info.shape)
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only memmap
        array = array.copy()
    return torch.from_numpy(array)


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's per-head RoPE row interleave of a Q or K projection `[out, in]`."""
    d = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
