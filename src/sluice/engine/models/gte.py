"""GTE's `NewModel`: Alibaba's RoPE encoder (gte-multilingual-base, gte-base-en-v1.5,
gte-large-en-v1.5; transformers' `GteModel`), as an embedding model.

    embeddings  LayerNorm(word + token type 0)                no position embeddings
    each layer  x = LayerNorm(x + out(attention(rope(q), rope(k), v)))
                x = LayerNorm(x + down(gelu(gate(x)) * up(x)))

NomicBERT's block (sluice.engine.models.nomic_bert, whose model runs it) with biases on
Q/K/V, out and down, a GELU gate, RoPE at `rope_theta` (160,000 by default) and token
types optional (`type_vocab_size` 0: none). Two spellings are read: the released
checkpoints' (Alibaba's code, `architectures` `NewModel`: `encoder.layer.N.attention.
qkv_proj` with Q, K, V stacked, `attention.o_proj`, `attn_ln`, `mlp.up_gate_proj` with
up and gate stacked, `mlp.down_proj`, `mlp_ln`) and transformers' `GteModel`'s. The
released checkpoints' sentence-transformers files pool the first token (CLS).
Refused, naming the key: RoPE scaling (gte-*-en-v1.5's `rope_scaling` ntk: not built),
an absolute position type, a norm other than LayerNorm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sluice.engine.models.bert import ACTIVATIONS
from sluice.engine.models.nomic_bert import NomicBert, NomicBertConfig, rope_encoder_from_weights
from sluice.protocol.errors import InvalidRequestError

GTE_ARCHITECTURES = ("NewModel", "GteModel")
# the released checkpoints' per-layer names -> transformers' (as its conversion renames)
_NEW_LAYER_NAMES = {"attention.o_proj": "self_attn.o_proj", "attn_ln": "post_attention_layernorm",
                    "mlp_ln": "post_mlp_layernorm", "mlp.down_proj": "mlp.down_proj"}


def gte_config(c: dict[str, Any]) -> NomicBertConfig:
    """config.json (Alibaba's `NewModel` or transformers' `GteModel`) -> the RoPE encoder's
    config; refuses what is not built, naming it."""
    from sluice.engine.models.loader import _matryoshka

    arch = c["architectures"][0]
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
        raise InvalidRequestError(f"{arch}: RoPE scaling (rope_scaling) is not supported",
                                  param="model")
    for key, built in (("position_embedding_type", "rope"), ("layer_norm_type", "layer_norm")):
        if c.get(key, built) != built:
            raise InvalidRequestError(f"{arch}: {key} {c[key]!r} is not supported "
                                      f"({built!r} only)", param="model")
    act = c.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise InvalidRequestError(f"{arch}: hidden_act {act!r} is not supported "
                                  f"({', '.join(ACTIVATIONS)})", param="model")
    return NomicBertConfig(
        arch, int(c["vocab_size"]), int(c["hidden_size"]), int(c["intermediate_size"]),
        int(c["num_hidden_layers"]), int(c["num_attention_heads"]),
        int(c.get("max_position_embeddings", 8192)), float(c.get("layer_norm_eps", 1e-12)),
        float(rope.get("rope_theta", c.get("rope_theta", 160000.0))),
        int(c.get("type_vocab_size", 1)), act, True, matryoshka_dimensions=_matryoshka(c))


def transformers_gte_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """A GTE checkpoint's tensors under transformers' names: the released spelling renamed
    and its stacked `qkv_proj` and `up_gate_proj` split (as transformers' conversion
    does); a task model's prefix (`new.`, `gte.`) and MLM / pooler heads dropped."""
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        name = name.removeprefix("new.").removeprefix("gte.")
        if name.startswith(("lm_head.", "pooler.", "classifier.")) or \
                name.endswith("position_ids"):
            continue
        parts = name.replace("encoder.layer.", "layers.").split(".")
        if parts[0] != "layers":
            out[name] = tensor
            continue
        layer, inner, kind = f"layers.{parts[1]}", ".".join(parts[2:-1]), parts[-1]
        if inner == "attention.qkv_proj":
            for part, rows in zip("qkv", tensor.chunk(3), strict=True):
                out[f"{layer}.self_attn.{part}_proj.{kind}"] = rows
        elif inner == "mlp.up_gate_proj":
            for part, rows in zip(("up", "gate"), tensor.chunk(2), strict=True):
                out[f"{layer}.mlp.{part}_proj.{kind}"] = rows
        else:
            out[f"{layer}.{_NEW_LAYER_NAMES.get(inner, inner)}.{kind}"] = tensor
    return out


def load_gte(directory: Path, c: dict[str, Any], device: torch.device,
             dtype: torch.dtype) -> tuple[NomicBert, NomicBertConfig]:
    """A GTE checkpoint directory's model (config.json read as `c`), its weights on
    `device` in `dtype`."""
    from sluice.engine.models.loader import read_safetensors

    cfg = gte_config(c)
    weights = transformers_gte_names(read_safetensors(directory))
    return rope_encoder_from_weights(cfg, weights, device, dtype), cfg
