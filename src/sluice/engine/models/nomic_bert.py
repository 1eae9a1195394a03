"""NomicBERT: nomic-ai's BERT with RoPE and SwiGLU (nomic-embed-text-v1 and v1.5, the
embedding model ollama and llama.cpp users pull as `nomic-embed-text`), as an embedding
model.

    embeddings  LayerNorm(word + token type 0)                no position embeddings
    each layer  x = LayerNorm(x + out(attention(rope(q), rope(k), v)))
                x = LayerNorm(x + down(silu(gate(x)) * up(x)))

Post-norm blocks as BERT's, no biases in the linears, RoPE over every pair of each head
(half-split, `rotary_emb_base` / `rope_theta`, 1,000 in the released models). The same
model with biases and a GELU gate is GTE's (sluice.engine.models.gte). It runs
in the encoder runner, as BERT does (sluice.engine.encoder_runner): whole inputs a step,
no KV cache; the released checkpoints' sentence-transformers files pool the mean.

Three spellings of the same weights are read: the released checkpoints' (nomic's own
code: `encoder.layers.N.attn.Wqkv`, `mlp.fc11` / `fc12` / `fc2`, `norm1` / `norm2`,
`emb_ln`, and config keys `n_embd`, `n_layer`, `n_head`, `n_inner`, `n_positions`,
`rotary_emb_base`), transformers' own `NomicBertModel`'s (`layers.N.self_attn.q_proj`,
`mlp.up_proj` ..., `hidden_size` ..., `rope_parameters`), and llama.cpp's `nomic-bert`
GGUF files' (sluice.engine.models.gguf_encoder). It serves `max_trained_positions`
(2,048 in the released models, whose `n_positions` says 8,192: past the trained length
nomic's code scales RoPE, which is not built; llama.cpp's converter also cuts the
context to 2,048). Refused, naming the key: a rotary fraction below 1, interleaved
rotation, RoPE scaling (`rotary_scaling_factor`), pre-norm blocks, biases, an
activation other than SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sluice.engine.models.bert import ACTIVATIONS, Linear, use_matmul
from sluice.engine.models.llama import RopeConfig, apply_rope, rope_tables
from sluice.protocol.errors import InvalidRequestError

NOMIC_BERT_ARCHITECTURES = ("NomicBertModel",)
# nomic's config.json key (its own code's) -> transformers' (the one read when both exist)
_CONFIG_KEYS = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
                "n_head": "num_attention_heads", "n_inner": "intermediate_size",
                "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layer_norm_eps"}
# what nomic's own code can configure that is not built, with the value that is
_FIXED = {"rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
          "rotary_scaling_factor": None, "prenorm": False, "qkv_proj_bias": False,
          "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False}


@dataclass(frozen=True)
class NomicBertConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float
    rope_theta: float
    type_vocab_size: int = 2  # 0: no token type embeddings (gte-base-en-v1.5)
    activation: str = "silu"  # of the gate: SwiGLU (NomicBERT) or GeGLU (GTE)
    bias: bool = False  # Q/K/V, out and down linears with biases (GTE's)
    labels: tuple[str, ...] = ()  # (no classifier heads: embeddings only)
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def classifier(self) -> bool:
        return False

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings


def nomic_bert_config(c: dict[str, Any]) -> NomicBertConfig:
    """config.json (nomic's keys or transformers') -> NomicBertConfig; refuses what is
    not built, naming it."""
    from sluice.engine.models.loader import _matryoshka

    arch = c["architectures"][0]
    c = {**{ours: c[theirs] for theirs, ours in _CONFIG_KEYS.items() if theirs in c}, **c}
    for key, built in _FIXED.items():
        if c.get(key, built) != built:
            raise InvalidRequestError(f"{arch}: {key} {c[key]!r} is not supported "
                                      f"({built!r} only)", param="model")
    act = c.get("activation_function", c.get("hidden_act", "swiglu"))
    if act not in ("swiglu", "silu"):
        raise InvalidRequestError(f"{arch}: activation {act!r} is not supported (SwiGLU only)",
                                  param="model")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
        raise InvalidRequestError(f"{arch}: RoPE scaling is not supported", param="model")
    return NomicBertConfig(
        arch, int(c["vocab_size"]), int(c["hidden_size"]),
        int(c.get("intermediate_size") or 4 * int(c["hidden_size"])),
        int(c["num_hidden_layers"]), int(c["num_attention_heads"]),
        int(c.get("max_trained_positions") or c.get("max_position_embeddings", 2048)),
        float(c.get("layer_norm_eps", 1e-12)),
        float(rope.get("rope_theta", c.get("rotary_emb_base", 1000.0))),
        int(c.get("type_vocab_size", 2)), matryoshka_dimensions=_matryoshka(c))


class NomicBertLayer(nn.Module):
    def __init__(self, cfg: NomicBertConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads = cfg.num_heads
        self.qkv = Linear(h, 3 * h, bias=cfg.bias)  # query, key, value stacked
        self.out = Linear(h, h, bias=cfg.bias)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.up = Linear(h, 2 * cfg.intermediate_size, bias=False)  # up, gate stacked
        self.down = Linear(cfg.intermediate_size, h, bias=cfg.bias)
        self.output_norm = nn.LayerNorm(h, eps=eps)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor, lengths: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        heads, hidden = self.num_heads, x.shape[-1]
        q, k, v = self.qkv(x).view(-1, 3, heads, hidden // heads).unbind(1)
        q, k = (apply_rope(t.float(), cos, sin).to(t.dtype) for t in (q, k))
        parts = []
        start = 0
        for n in lengths:  # each sequence attends within itself, all ways
            rows = slice(start, start + n)
            q1, k1, v1 = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            parts.append(nn.functional.scaled_dot_product_attention(q1, k1, v1)[0]
                         .transpose(0, 1).reshape(n, hidden))
            start += n
        x = self.attention_norm(x + self.out(torch.cat(parts)))
        up, gate = self.up(x).chunk(2, dim=-1)
        return self.output_norm(x + self.down(self.act(gate) * up))


class NomicBert(nn.Module):
    """The encoder runner's model (as `bert.Encoder`): `forward` gives every token's
    final hidden state."""

    def __init__(self, cfg: NomicBertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h)
        self.token_type = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(NomicBertLayer(cfg) for _ in range(cfg.num_layers))
        self.set_rope()

    rope_table: Tensor  # [cos, signed sin] of every position, float32
    use_matmul = use_matmul
    classifier_pooling = "cls"  # (no classifier)

    def set_rope(self) -> None:
        """(Re)make `rope_table` (not in checkpoints: a model built on the meta device
        gets a real one after loading)."""
        head_dim = self.cfg.hidden_size // self.cfg.num_heads
        table = rope_tables(RopeConfig(self.cfg.rope_theta), head_dim, self.cfg.max_len)
        self.register_buffer("rope_table", torch.stack(table), persistent=False)

    def forward(self, sequences: list[list[int]], separator: int | None = None) -> Tensor:
        """Every token's final hidden state, the sequences' rows one after another
        (token type 0 throughout: `separator` is not read)."""
        device = self.word.weight.device
        tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
        x = self.embed_norm(self.word(tokens) + self.token_type.weight[0])
        cos, sin = self.rope_table[:, positions, None]
        lengths = [len(s) for s in sequences]
        for layer in self.layers:
            x = layer(x, lengths, cos, sin)
        return x


# nomic's own tensor names -> transformers' (as transformers converts them), per layer
_NOMIC_LAYER_NAMES = {"attn.out_proj": "self_attn.o_proj", "mlp.fc11": "mlp.up_proj",
                      "mlp.fc12": "mlp.gate_proj", "mlp.fc2": "mlp.down_proj",
                      "norm1": "post_attention_layernorm", "norm2": "post_mlp_layernorm"}
# our parameter -> transformers' tensors (stacked in this order where several)
_LAYER_NAMES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "out": ("self_attn.o_proj",), "attention_norm": ("post_attention_layernorm",),
                "up": ("mlp.up_proj", "mlp.gate_proj"), "down": ("mlp.down_proj",),
                "output_norm": ("post_mlp_layernorm",)}
_TOP_NAMES = {"word": "embeddings.word_embeddings",
              "token_type": "embeddings.token_type_embeddings",
              "embed_norm": "embeddings.LayerNorm"}


def transformers_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's tensors under transformers' names: nomic's own spelling renamed and
    its stacked `Wqkv` split (as transformers' conversion does); a task model's prefix
    (`nomic_bert.`, `bert.`) and MLM / pooler heads dropped."""
    out: dict[str, Tensor] = {}
    for name, tensor in weights.items():
        name = name.removeprefix("nomic_bert.").removeprefix("bert.")
        if name.startswith(("cls.", "lm_head.", "pooler.")) or name.endswith("position_ids"):
            continue
        name = name.replace("encoder.layers.", "layers.").replace("emb_ln.",
                                                                  "embeddings.LayerNorm.")
        parts = name.split(".")
        if parts[0] == "layers" and ".".join(parts[2:4]) == "attn.Wqkv":
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3), strict=True):
                out[f"layers.{parts[1]}.self_attn.{part}.{parts[-1]}"] = rows
            continue
        if parts[0] == "layers":
            inner = ".".join(parts[2:-1])
            name = ".".join([*parts[:2], _NOMIC_LAYER_NAMES.get(inner, inner), parts[-1]])
        out[name] = tensor
    return out


def nomic_bert_from_weights(cfg: NomicBertConfig, raw: dict[str, Tensor], device: torch.device,
                            dtype: torch.dtype) -> NomicBert:
    """The model of `cfg` from a checkpoint's tensors in any of its spellings but
    llama.cpp's (renamed to nomic's first: sluice.engine.models.gguf_encoder)."""
    return rope_encoder_from_weights(cfg, transformers_names(raw), device, dtype)


def rope_encoder_from_weights(cfg: NomicBertConfig, weights: dict[str, Tensor],
                              device: torch.device, dtype: torch.dtype) -> NomicBert:
    """The model of `cfg` from tensors under transformers' NomicBERT / GTE names."""

    def take(name: str) -> Tensor:
        if name not in weights:
            raise InvalidRequestError(f"{cfg.architecture}: missing tensor {name!r}",
                                      param="model")
        return weights.pop(name)

    state = {f"{ours}.weight": take(f"{theirs}.weight") for ours, theirs in _TOP_NAMES.items()
             if ours != "token_type" or cfg.type_vocab_size}
    state.setdefault("token_type.weight", torch.zeros(1, cfg.hidden_size))  # none: adds 0
    state["embed_norm.bias"] = take("embeddings.LayerNorm.bias")
    for i in range(cfg.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            state[f"layers.{i}.{ours}.weight"] = torch.cat(
                [take(f"layers.{i}.{t}.weight") for t in theirs])
            if ours.endswith("norm") or (cfg.bias and ours != "up"):
                state[f"layers.{i}.{ours}.bias"] = torch.cat(
                    [take(f"layers.{i}.{t}.bias") for t in theirs])
    if weights:
        raise InvalidRequestError(f"{cfg.architecture}: unexpected tensors "
                                  f"{sorted(weights)[:5]}", param="model")
    with torch.device("meta"):
        model = NomicBert(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True,
                          strict=False)
    model.set_rope()
    return model.to(device).eval()


def load_nomic_bert(directory: Path, c: dict[str, Any], device: torch.device,
                    dtype: torch.dtype) -> tuple[NomicBert, NomicBertConfig]:
    """A NomicBERT checkpoint directory's model (config.json read as `c`), its weights
    on `device` in `dtype`."""
    from sluice.engine.models.loader import read_safetensors

    cfg = nomic_bert_config(c)
    return nomic_bert_from_weights(cfg, read_safetensors(directory), device, dtype), cfg
