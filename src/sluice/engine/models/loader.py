"""Load a model from a Hugging Face checkpoint directory, a hub name, or a GGUF file.

    load_model("path/to/dir")              config.json + *.safetensors
    load_model("Qwen/Qwen2.5-0.5B-Instruct")   huggingface_hub.snapshot_download, then as a dir
    load_model("model.gguf") / None        gguf_loader (None: the default SmolLM2 GGUF)

Architectures come from a registry (`ARCHITECTURES`), keyed by the `architectures`
entry of config.json; an unknown one is an `InvalidRequestError` naming it. Both
config styles are read: transformers <5 (`rope_theta`, `rope_scaling`) and 5
(`rope_parameters`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sluice.engine.models.llama import (
    BLOCK_NORMS,
    ROPE_REQUIRED_PARAMS,
    GemmaConfig,
    GraniteScales,
    LlamaConfig,
    MoEConfig,
    RopeConfig,
    Transformer,
    build_model,
)
from sluice.engine.tokenizer import ModelNotFoundError, local_model_path
from sluice.protocol.errors import InvalidRequestError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArchSpec:
    """What distinguishes one Llama-family architecture from another."""

    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_whole: bool = False
    granite: bool = False  # its multipliers (GraniteScales)
    moe: str | None = None  # a mixture of experts, configured as `_moe` reads `kind`
    gemma: bool = False  # Gemma's norms, GELU, local layers and soft caps (GemmaConfig)
    block_norms: str = "llama"  # a key of BLOCK_NORMS: which norms a block has
    # runs `sliding_window` in some layers (not a cap on the context): every this many
    # layers one global, where the config has no `layer_types` (0: no windows run)
    sliding_period: int = 0
    nope_global: bool = False  # EXAONE 4: with windows, the global layers without RoPE
    rope_interleaved: bool = False  # GLM: RoPE over adjacent pairs (LlamaConfig's)
    o_bias: bool = True  # False: `attention_bias` puts a bias on Q/K/V alone (GLM)
    activation: str = "silu"  # its MLP's `hidden_act` (checked): a key of MLP_ACTIVATION_OF


# an MLP's `hidden_act` -> LlamaConfig.mlp_activation
MLP_ACTIVATION_OF = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu2": "relu2"}

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    "SmolLM3ForCausalLM": ArchSpec(),
    "GraniteForCausalLM": ArchSpec(granite=True),
    # Granite 4.0's transformer models (granite-4.0-micro, -1b, -350m): Granite 3 with the
    # MLP under `shared_mlp` (split_fused_weights); the Mamba hybrids ("-h-") refused
    "GraniteMoeHybridForCausalLM": ArchSpec(granite=True),
    "MixtralForCausalLM": ArchSpec(moe="mixtral"),
    "Qwen2MoeForCausalLM": ArchSpec(qkv_bias=True, moe="qwen2_moe"),
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, moe="qwen3_moe"),
    "GraniteMoeForCausalLM": ArchSpec(granite=True, moe="granitemoe"),
    "OlmoeForCausalLM": ArchSpec(qk_norm_whole=True, moe="olmoe"),
    "Olmo2ForCausalLM": ArchSpec(qk_norm_whole=True, block_norms="olmo2"),
    "Olmo3ForCausalLM": ArchSpec(qk_norm_whole=True, block_norms="olmo2", sliding_period=4),
    "Exaone4ForCausalLM": ArchSpec(qk_norm=True, block_norms="olmo2", sliding_period=4,
                                   nope_global=True),
    "Phi3ForCausalLM": ArchSpec(),  # its fused qkv_proj / gate_up_proj: split_fused_weights
    # GLM-4 (glm-4-9b-chat-hf) and GLM-4-0414 (its sandwich norms): RoPE over adjacent
    # pairs of half of each head, gate|up fused in the checkpoint (split_fused_weights)
    "GlmForCausalLM": ArchSpec(rope_interleaved=True, o_bias=False),
    # Kyutai's Helium: a Llama whose RoPE turns adjacent pairs (all of each head), its
    # `attention_bias` on Q/K/V alone, as GLM's
    "HeliumForCausalLM": ArchSpec(rope_interleaved=True, o_bias=False),
    "Glm4ForCausalLM": ArchSpec(rope_interleaved=True, o_bias=False, block_norms="glm4"),
    # Arcee's AFM: a Llama whose MLP is relu(up)² with no gate
    "ArceeForCausalLM": ArchSpec(activation="relu2"),
    "Gemma2ForCausalLM": ArchSpec(gemma=True, block_norms="gemma", sliding_period=2,
                                  activation="gelu_pytorch_tanh"),
    "Gemma3ForCausalLM": ArchSpec(qk_norm=True, gemma=True, block_norms="gemma",
                                  sliding_period=6, activation="gelu_pytorch_tanh"),
}


class UnsupportedModelError(InvalidRequestError):
    """The checkpoint's architecture or a feature of it is not implemented."""


def load_model(model: str | None, device: torch.device, dtype: torch.dtype,
               revision: str | None = None, overrides: dict[str, Any] | None = None
               ) -> tuple[Transformer, LlamaConfig]:
    """Weights on `device` in `dtype`, and the hyperparameters; `overrides`: config.json's
    keys to replace (`--hf-overrides`; a checkpoint directory's only). A
    `*ForSequenceClassification` checkpoint's `score` head is the model's `classifier`
    (a buffer; None for others), its output head the embedding (it generates nothing)."""
    path = local_model_path(model, revision)
    if path.is_file() and path.suffix == ".gguf":
        from sluice.engine.models.gguf_loader import load_gguf_model

        if overrides:
            raise InvalidRequestError("hf_overrides replaces a checkpoint's config.json; "
                                      f"{path.name} is a GGUF file", param="hf_overrides")
        return load_gguf_model(path, device, dtype)
    if not path.is_dir():
        raise ModelNotFoundError(f"model {str(path)!r} is neither a .gguf file nor a "
                                 "checkpoint directory", param="model")
    raw = overridden(read_config(path), overrides)
    cfg, weights = base_model_weights(config_from_hf(raw), read_safetensors(path))
    score = None
    if cfg.labels and raw.get("classifier_from_token"):
        score = score_from_tokens(path, cfg, weights, raw)
    elif cfg.labels:
        if "score.weight" not in weights:
            raise InvalidRequestError(f"{cfg.architecture}: missing tensor 'score.weight'",
                                      param="model")
        score = weights.pop("score.weight")
        if "lm_head.weight" not in weights:
            cfg = replace(cfg, tie_word_embeddings=True)
    built = build_model(cfg, split_fused_weights(cfg, weights), device, dtype)
    built.register_buffer("classifier", None if score is None else score.to(device, dtype))
    return built, cfg


def overridden(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """config.json with `overrides`' keys replaced; a `rope_scaling` override (transformers
    4's name, which Qwen's model cards give) takes the place of a transformers 5 config's
    `rope_parameters`, that RoPE's base kept."""
    config, overrides = dict(config), overrides or {}
    if "rope_scaling" in overrides and "rope_parameters" in config:
        theta = (config.pop("rope_parameters") or {}).get("rope_theta")
        if theta is not None:
            config.setdefault("rope_theta", theta)
    config.update(overrides)
    return config


def split_fused_weights(cfg: LlamaConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Phi-3's checkpoints fuse Q|K|V (`self_attn.qkv_proj`) and gate|up
    (`mlp.gate_up_proj`), Granite 4.0's gate|up (`shared_mlp.input_linear`, its down
    projection `shared_mlp.output_linear`), in the order this model fuses them: split
    into the separate names the model file reads (views, no copy; it concatenates them
    again)."""
    out = {}
    for name, tensor in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            q, k, v = tensor.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            out.update({base + "q_proj.weight": q, base + "k_proj.weight": k,
                        base + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            out.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        elif name.endswith("shared_mlp.input_linear.weight"):  # Granite 4.0's gate|up
            base = name.removesuffix("shared_mlp.input_linear.weight") + "mlp."
            gate, up = tensor.chunk(2)
            out.update({base + "gate_proj.weight": gate, base + "up_proj.weight": up})
        elif name.endswith("shared_mlp.output_linear.weight"):
            out[name.removesuffix("shared_mlp.output_linear.weight") + "mlp.down_proj.weight"] = tensor
        else:
            out[name] = tensor
    return out


def base_model_weights(cfg: LlamaConfig, weights: dict[str, Tensor]
                       ) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """A checkpoint saved from the base model (`Qwen3Model`, not `...ForCausalLM`), as
    embedding models are (Qwen3-Embedding's config.json names `Qwen3ForCausalLM`; its
    tensors are `embed_tokens.weight`, `layers.0...`, no `lm_head`): its names under the
    causal LM's `model.` prefix, and without a head its output tied to the embedding
    (vLLM reads these checkpoints the same way). Other checkpoints pass unchanged."""
    if "model.embed_tokens.weight" in weights or "embed_tokens.weight" not in weights:
        return cfg, weights
    weights = {f"model.{name}": tensor for name, tensor in weights.items()}
    if "lm_head.weight" not in weights and not cfg.tie_word_embeddings:
        log.info("%s checkpoint without an LM head (a base model, e.g. for embeddings): its "
                 "output is the embedding matrix", cfg.architecture)
        cfg = replace(cfg, tie_word_embeddings=True)
    return cfg, weights


def read_config(directory: Path) -> dict[str, Any]:
    file = directory / "config.json"
    if not file.is_file():
        raise ModelNotFoundError(f"{directory}: missing file config.json", param="model")
    with open(file, encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def config_from_hf(c: dict[str, Any]) -> LlamaConfig:
    """config.json -> LlamaConfig; rejects architectures and features not implemented."""
    arch = (c.get("architectures") or [c.get("model_type", "?")])[0]
    if arch == "Gemma3TextModel":  # EmbeddingGemma's base model: Gemma 3's text blocks
        arch = "Gemma3ForCausalLM"
    # a classifier (a reward model, Qwen2ForSequenceClassification): the causal LM's
    # architecture with a `score` head on the last token instead of the LM head
    classifier = arch.endswith("ForSequenceClassification")
    spec = ARCHITECTURES.get(arch.replace("ForSequenceClassification", "ForCausalLM")
                             if classifier else arch)
    if spec is None:
        raise UnsupportedModelError(f"unsupported model architecture {arch!r} "
                                    f"(supported: {sorted(ARCHITECTURES)})", param="model")
    # Phi-4-mini's 0.75: RoPE on part of each head
    rotary = (c.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                  c.get("partial_rotary_factor", 1.0))
    if c.get("clip_qkv") is not None:  # OLMo's clamp of Q, K and V
        raise UnsupportedModelError(f"{arch}: clip_qkv is not supported", param="model")
    act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    if act != spec.activation or c.get("mlp_bias"):
        raise UnsupportedModelError(f"{arch}: only bias-free {spec.activation} MLPs are "
                                    f"supported, not {act!r}", param="model")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(cap) is not None and not spec.gemma:  # Gemma 2's tanh caps
            raise UnsupportedModelError(f"{arch}: {cap} is not supported", param="model")
    bidirectional = bool(c.get("use_bidirectional_attention"))  # EmbeddingGemma's
    if bidirectional and arch != "Gemma3ForCausalLM":
        raise UnsupportedModelError(f"{arch}: use_bidirectional_attention is supported for "
                                    "Gemma 3 (EmbeddingGemma) only", param="model")
    if arch == "GraniteMoeHybridForCausalLM":
        c = _granite_hybrid(c)
    heads = int(c["num_attention_heads"])
    rope = rope_from_hf(c)
    sliding = _sliding(c, arch, spec.sliding_period, rope) if spec.sliding_period else {}
    return LlamaConfig(
        architecture=arch, vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]), num_layers=int(c["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_max_positions(c, spec, rope),
        rope=rope, partial_rotary_factor=float(rotary),
        qkv_bias=bool(c.get("qkv_bias", spec.qkv_bias) or c.get("attention_bias")),
        o_bias=bool(c.get("attention_bias")) and spec.o_bias,
        rope_interleaved=spec.rope_interleaved,
        qk_norm=spec.qk_norm, qk_norm_whole=spec.qk_norm_whole,
        block_norms=BLOCK_NORMS[spec.block_norms],
        # EXAONE 4's global layers, where it slides, rotate nothing
        no_rope_layers=sliding["sliding_layers"] if spec.nope_global and sliding
        else _no_rope_layers(c),
        granite=_granite_scales(c) if spec.granite else None,
        moe=_moe(c, spec.moe) if spec.moe else None,
        gemma=_gemma(c) if spec.gemma else None,
        **sliding,
        # Gemma's config.json may leave it out: its default is tied
        tie_word_embeddings=bool(c.get("tie_word_embeddings", spec.gemma)),
        mlp_activation=MLP_ACTIVATION_OF[act],
        matryoshka_dimensions=None if classifier else _matryoshka(c),
        labels=classifier_labels(c) if classifier else (),
        bidirectional=bidirectional,
        multi_label=c.get("problem_type") == "multi_label_classification")


def score_from_tokens(path: Path, cfg: LlamaConfig, weights: dict[str, Tensor],
                      raw: dict[str, Any]) -> Tensor:
    """A causal LM read as a classifier through its LM head's rows of some tokens (vLLM's
    `classifier_from_token` override): each token's row a label's, or, for Qwen3-Reranker
    (`is_original_qwen3_reranker`, tokens ["no", "yes"]), one label scored by the "yes"
    row less the "no" row (sigmoid(logit_yes - logit_no), the model card's softmax over
    the two)."""
    from sluice.engine.tokenizer import load_tokenizer

    backend = load_tokenizer(str(path)).backend
    ids = []
    for token in raw["classifier_from_token"]:
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise InvalidRequestError(f"classifier_from_token: {token!r} is not a token of "
                                      "this tokenizer", param="hf_overrides")
        ids.append(token_id)
    head = weights.get("lm_head.weight")
    if head is None or cfg.tie_word_embeddings:
        head = weights["model.embed_tokens.weight"]
    rows = head[ids].float()
    if raw.get("is_original_qwen3_reranker"):
        if len(ids) != 2:
            raise InvalidRequestError("is_original_qwen3_reranker takes classifier_from_token "
                                      "[\"no\", \"yes\"]", param="hf_overrides")
        return (rows[1] - rows[0]).unsqueeze(0)
    return rows


def classifier_labels(c: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's label names in id order (`id2label`; LABEL_i where it has none; a
    head made of token rows: the tokens, or one label for Qwen3-Reranker's)."""
    if c.get("classifier_from_token"):
        tokens = tuple(str(t) for t in c["classifier_from_token"])
        return ("score",) if c.get("is_original_qwen3_reranker") else tokens
    names = {int(k): str(v) for k, v in (c.get("id2label") or {}).items()}
    count = int(c.get("num_labels") or len(names) or 2)
    return tuple(names.get(i, f"LABEL_{i}") for i in range(count))


def _matryoshka(c: dict[str, Any]) -> tuple[int, ...] | None:
    """The sizes an embedding may be cut to (vLLM's `matryoshka_dimensions`; () with
    `is_matryoshka` alone: any), or None: not a Matryoshka model."""
    listed = c.get("matryoshka_dimensions")
    if listed is not None:
        return tuple(int(d) for d in listed)
    return () if c.get("is_matryoshka") else None


def _granite_hybrid(c: dict[str, Any]) -> dict[str, Any]:
    """A Granite 4.0 config as Granite 3's: every layer attention (a Mamba layer, the
    "-h-" models', is refused), no experts, the MLP `shared_intermediate_size` wide, and
    RoPE only where `position_embedding_type` is "rope" (None: no layer rotates)."""
    kinds = c.get("layer_types") or c.get("layers_block_type") or []
    if set(kinds) - {"attention", "full_attention"}:  # (transformers 5 writes the latter)
        raise UnsupportedModelError("GraniteMoeHybridForCausalLM: Mamba layers (the Granite "
                                    "4.0 H models) are not supported; its transformer models "
                                    "are (every layer 'attention')", param="model")
    if int(c.get("num_local_experts") or 0):
        raise UnsupportedModelError("GraniteMoeHybridForCausalLM: experts "
                                    "(num_local_experts) are not supported", param="model")
    layers = int(c["num_hidden_layers"])
    rope = c.get("position_embedding_type") == "rope"
    return {**c, "intermediate_size": c["shared_intermediate_size"],
            "no_rope_layers": None if rope else [0] * layers}


def _sliding(c: dict[str, Any], arch: str, period: int, rope: RopeConfig) -> dict[str, Any]:
    """The layers that attend through `sliding_window` (LlamaConfig's fields; none where
    the config has no window, as EXAONE-4.0-1.2B's): `layer_types` ("sliding_attention" /
    "full_attention"), else every `sliding_window_pattern`-th layer global (or the
    pattern spelled out, EXAONE's "LLLG": L local, G global, repeated), else every
    `period`-th (Gemma 3's 6: five local, one global; Gemma 2's every other; OLMo 3's and
    EXAONE 4's every fourth). Their RoPE:
    transformers 5's `rope_parameters["sliding_attention"]`, else Gemma 3's
    `rope_local_base_freq` (10,000 by default), else Gemma 2's global `rope`, else (OLMo 3)
    `rope`'s base without its scaling (its YaRN is the full layers' alone)."""
    if c.get("sliding_window") is None:
        return {}
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    pattern = c.get("sliding_window_pattern") or period
    if types is None and isinstance(pattern, str):
        types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                 for i in range(layers)]
    elif types is None:
        types = ["full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention"
                 for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types!r} is not one of sliding_attention / "
                                    f"full_attention for each of {layers} layers", param="model")
    params = c.get("rope_parameters") or {}
    if "sliding_attention" in params:
        local = rope_from_hf({"rope_parameters": params["sliding_attention"]})
    elif arch == "Gemma3ForCausalLM":
        local = RopeConfig(theta=float(c.get("rope_local_base_freq", 10000.0)))
    elif arch == "Gemma2ForCausalLM":
        local = rope
    else:
        local = RopeConfig(theta=rope.theta)
    window = int(c["sliding_window"])
    if c.get("use_bidirectional_attention"):  # transformers': |q - k| < window // 2 + 1
        window = window // 2 + 1
    return {"sliding_window": window,
            "sliding_layers": tuple(int(t == "sliding_attention") for t in types),
            "local_rope": local}


def _gemma(c: dict[str, Any]) -> GemmaConfig:
    """Gemma's score scale (`query_pre_attn_scalar`, else head_dim) and Gemma 2's soft
    caps (its sliding layers: `_sliding`)."""
    caps = [c.get(k) for k in ("attn_logit_softcapping", "final_logit_softcapping")]
    return GemmaConfig(query_pre_attn_scalar=float(
                           c.get("query_pre_attn_scalar") or c.get("head_dim")
                           or int(c["hidden_size"]) // int(c["num_attention_heads"])),
                       attn_softcap=None if caps[0] is None else float(caps[0]),
                       final_softcap=None if caps[1] is None else float(caps[1]))


def _granite_scales(c: dict[str, Any]) -> GraniteScales:
    attention = c.get("attention_multiplier")
    return GraniteScales(embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
                         residual_multiplier=float(c.get("residual_multiplier", 1.0)),
                         attention_multiplier=None if attention is None else float(attention),
                         logits_scaling=float(c.get("logits_scaling", 1.0)))


def _moe(c: dict[str, Any], kind: str) -> MoEConfig:
    """The experts of `kind`. Mixtral's and Granite's: `num_local_experts` of
    `intermediate_size`, weights always renormalized (Granite's softmax over the top-k
    scores is the same), Granite's stacked in one tensor a projection. Qwen2-MoE's and
    Qwen3-MoE's: `num_experts` of `moe_intermediate_size`, `norm_topk_prob`, dense layers
    of `intermediate_size` where `mlp_only_layers` or `decoder_sparse_step` say, and
    Qwen2-MoE's shared expert of `shared_expert_intermediate_size`. OLMoE's: `num_experts`
    of `intermediate_size` in every layer, `norm_topk_prob`."""
    layers, top_k = int(c["num_hidden_layers"]), int(c["num_experts_per_tok"])
    if kind in ("mixtral", "granitemoe"):
        return MoEConfig(num_experts=int(c["num_local_experts"]), top_k=top_k,
                         intermediate_size=int(c["intermediate_size"]),
                         hf_block="block_sparse_moe", hf_parts=("w1", "w3", "w2"),
                         hf_stacked=kind == "granitemoe")
    experts = c.get("num_experts") or c["num_local_experts"]  # the hub's; transformers 5's
    if kind == "olmoe":
        return MoEConfig(num_experts=int(experts), top_k=top_k,
                         intermediate_size=int(c["intermediate_size"]),
                         norm_topk_prob=bool(c.get("norm_topk_prob", False)))
    step = int(c.get("decoder_sparse_step") or 1)
    only_mlp = {int(i) for i in c.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
    shared = int(c.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    return MoEConfig(num_experts=int(experts), top_k=top_k,
                     intermediate_size=int(c["moe_intermediate_size"]),
                     norm_topk_prob=bool(c.get("norm_topk_prob", False)), dense_layers=dense,
                     shared_intermediate_size=shared)


def _no_rope_layers(c: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's NoPE layers: `no_rope_layers` (1 rotates, 0 does not), else every
    `no_rope_layer_interval`-th layer without RoPE; () where neither is set."""
    layers = int(c["num_hidden_layers"])
    flags = c.get("no_rope_layers")
    if flags is None and c.get("no_rope_layer_interval"):
        interval = int(c["no_rope_layer_interval"])
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if flags is None:
        return ()
    if len(flags) != layers:
        raise UnsupportedModelError(f"no_rope_layers has {len(flags)} entries for {layers} "
                                    "layers", param="model")
    return tuple(int(bool(f)) for f in flags)


def _max_positions(c: dict[str, Any], spec: ArchSpec, rope: RopeConfig) -> int:
    """The context limit: `max_position_embeddings` as `rope` scales it
    (`RopeConfig.scaled_context`); a sliding window caps it where the model does not run
    one (full attention is exact within it): Gemma's and OLMo 3's local layers do."""
    limit = rope.scaled_context(int(c.get("max_position_embeddings", 2048)))
    window = c.get("sliding_window")
    if window and c.get("use_sliding_window", True) and not spec.sliding_period:
        limit = min(limit, int(window))
    return limit


def rope_from_hf(c: dict[str, Any]) -> RopeConfig:
    """RoPE from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (<5);
    per layer kind in transformers 5's Gemma 3 config: the full-attention layers' here.
    What transformers fills in for llama3, YaRN, longrope and dynamic NTK, filled the same
    way: the original context (a top-level `original_max_position_embeddings`, Phi-3's,
    first; then the scaling's own; then `max_position_embeddings`) and a missing `factor`
    (the context over the original). Phi-3's early name for longrope, "su", is longrope."""
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", c.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # LlamaConfig's
    named = params.pop("rope_type", None), params.pop("type", None)  # (transformers <4.45: type)
    rope_type = named[0] or named[1] or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type
    if "original_max_position_embeddings" in ROPE_REQUIRED_PARAMS.get(rope_type, ()):
        context = c.get("max_position_embeddings")
        original = (c.get("original_max_position_embeddings")
                    or params.get("original_max_position_embeddings") or context)
        params["original_max_position_embeddings"] = original
        if params.get("factor") is None and context and original:
            params["factor"] = float(context) / float(original)
    return RopeConfig(theta=theta, rope_type=rope_type, params=params)


def read_safetensors(directory: Path) -> dict[str, Tensor]:
    """All tensors of every `*.safetensors` file in the directory (memory-mapped, CPU)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{directory}: missing weights (no *.safetensors file)",
                                 param="model")
    weights: dict[str, Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights
