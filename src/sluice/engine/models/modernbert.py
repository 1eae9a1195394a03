"""ModernBERT: the encoder of Answer.AI and LightOn (2024), as embedding models
(Alibaba's gte-modernbert, nomic's modernbert-embed) and classifiers (gte-reranker-
modernbert, `ModernBertForSequenceClassification`).

    embeddings  LayerNorm(word)                              no position embeddings
    each layer  x = x + out(attention(rope(q), rope(k), v))  on attn_norm(x); layer 0: x
                x = x + down(gelu(gate) * up)                on mlp_norm(x) (GeGLU)
    final       LayerNorm(x)

Pre-norm blocks, no biases by default (`attention_bias`, `mlp_bias`, `norm_bias`).
Attention alternates: every `global_attn_every_n_layers`-th layer (0, 3, 6, ...) sees
the whole sequence with RoPE at `global_rope_theta` (160,000), the others the tokens at
most `local_attention // 2` away on either side with RoPE at `local_rope_theta` (10,000):
transformers' rule (`|q - k| <= sliding_window`), computed a block of queries at a time
against only the keys they see (`local_attention`). A classifier pools the first token's
state (`classifier_pooling` cls) or the mean of all (mean), then `head` (dense, act,
LayerNorm) and `classifier`. It runs in the encoder runner, as BERT does
(sluice.engine.encoder_runner): whole inputs a step, no KV cache.
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

MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForSequenceClassification")


@dataclass(frozen=True)
class ModernBertConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    norm_eps: float
    activation: str
    global_layers: tuple[bool, ...]  # per layer: full attention (else the local window)
    global_theta: float
    local_theta: float
    window: int  # a local layer's query sees keys at most this far away (local_attention // 2)
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    labels: tuple[str, ...] = ()  # a classifier's (config.json's id2label), in id order
    multi_label: bool = False
    classifier_pooling: str = "cls"  # "cls" or "mean": what the classifier's head reads
    classifier_activation: str = "gelu"
    classifier_bias: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    type_vocab_size: int = 1  # (no token types: a pair is one sequence)

    @property
    def classifier(self) -> bool:
        return bool(self.labels)

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings


def modernbert_config(c: dict[str, Any]) -> ModernBertConfig:
    """config.json -> ModernBertConfig (the original keys, or transformers' newer
    `layer_types` and `rope_parameters`); refuses what is not built, naming it."""
    from sluice.engine.models.loader import _matryoshka, classifier_labels

    arch = c["architectures"][0]
    layers = int(c["num_hidden_layers"])
    every = int(c.get("global_attn_every_n_layers", 3))
    types = c.get("layer_types") or ["full_attention" if i % every == 0 else
                                     "sliding_attention" for i in range(layers)]
    rope = c.get("rope_parameters") or {}
    thetas = {}
    for kind, key, default in (("full_attention", "global_rope_theta", 160000.0),
                               ("sliding_attention", "local_rope_theta", 10000.0)):
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default" or c.get("rope_scaling"):
            raise InvalidRequestError(f"{arch}: RoPE scaling is not supported", param="model")
        thetas[kind] = float(params.get("rope_theta", c.get(key, default)))
    for name in ("hidden_activation", "classifier_activation"):
        if c.get(name, "gelu") not in ACTIVATIONS:
            raise InvalidRequestError(f"{arch}: {name} {c.get(name)!r} is not supported "
                                      f"({', '.join(ACTIVATIONS)})", param="model")
    pooling = c.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise InvalidRequestError(f"{arch}: classifier_pooling {pooling!r} is not supported "
                                  "(cls, mean)", param="model")
    classifier = arch.endswith("ForSequenceClassification")
    return ModernBertConfig(
        arch, int(c["vocab_size"]), int(c["hidden_size"]), int(c["intermediate_size"]),
        layers, int(c["num_attention_heads"]), int(c.get("max_position_embeddings", 8192)),
        float(c.get("norm_eps", 1e-5)), c.get("hidden_activation", "gelu"),
        tuple(t == "full_attention" for t in types), thetas["full_attention"],
        thetas["sliding_attention"], int(c.get("local_attention", 128)) // 2,
        bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False)),
        bool(c.get("norm_bias", False)), classifier_labels(c) if classifier else (),
        c.get("problem_type") == "multi_label_classification", pooling,
        c.get("classifier_activation", "gelu"), bool(c.get("classifier_bias", False)),
        None if classifier else _matryoshka(c))


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_eps
        self.num_heads = cfg.num_heads
        self.full = cfg.global_layers[index]
        self.window = cfg.window
        self.attn_norm = nn.LayerNorm(h, eps=eps, bias=cfg.norm_bias) if index else None
        self.qkv = Linear(h, 3 * h, bias=cfg.attention_bias)
        self.out = Linear(h, h, bias=cfg.attention_bias)
        self.mlp_norm = nn.LayerNorm(h, eps=eps, bias=cfg.norm_bias)
        self.up = Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # input, gate
        self.down = Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor, lengths: list[int], rope: dict[bool, tuple[Tensor, Tensor]]
                ) -> Tensor:
        heads, hidden = self.num_heads, x.shape[-1]
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.qkv(h).view(-1, 3, heads, hidden // heads).unbind(1)
        cos, sin = rope[self.full]  # (float32: the rotation in float32, as transformers')
        q, k = (apply_rope(t.float(), cos, sin).to(t.dtype) for t in (q, k))
        parts = []
        start = 0
        for n in lengths:  # each sequence attends within itself (a local layer: nearby)
            rows = slice(start, start + n)
            q1, k1, v1 = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out = nn.functional.scaled_dot_product_attention(q1, k1, v1) \
                if self.full or n <= self.window + 1 else local_attention(q1, k1, v1,
                                                                          self.window)
            parts.append(out[0].transpose(0, 1).reshape(n, hidden))
            start += n
        x = x + self.out(torch.cat(parts))
        up, gate = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(self.act(up) * gate)


def local_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Attention of (1, heads, n, head_dim) queries to the keys at most `window` away, a
    block of 2 * window queries at a time against only the keys any of them sees:

        queries  [s, e)                    e = s + 2w
        keys     [s - w, e + w)            4w keys, not n; masked to |i - j| <= w

    so a long input costs O(n * w), not O(n^2) (an 8,192-token input: 32x fewer scores
    at ModernBERT's w = 64)."""
    n, block = q.shape[2], 2 * window
    outs = []
    for s in range(0, n, block):
        e = min(n, s + block)
        lo, hi = max(0, s - window), min(n, e + window)
        mask = (torch.arange(s, e, device=q.device)[:, None]
                - torch.arange(lo, hi, device=q.device)[None, :]).abs() <= window
        outs.append(nn.functional.scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi], mask))
    return torch.cat(outs, dim=2)


class ModernBert(nn.Module):
    """The encoder runner's model (as `bert.Encoder`): `forward` gives every token's final
    hidden state, `classify` a classifier's logits of pooled states."""

    def __init__(self, cfg: ModernBertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
        self.set_rope()
        if cfg.classifier:
            self.head_dense = Linear(h, h, bias=cfg.classifier_bias)
            self.head_norm = nn.LayerNorm(h, eps=cfg.norm_eps, bias=cfg.norm_bias)
            self.head_out = Linear(h, len(cfg.labels))
            self.head_act = ACTIVATIONS[cfg.classifier_activation]

    # RoPE's tables of every position, float32: [global, local] x [cos, signed sin]
    rope_table: Tensor
    use_matmul = use_matmul

    def set_rope(self) -> None:
        """(Re)make `rope_table` with the decoder's `rope_tables` at each kind of layer's
        theta (not in checkpoints: a model built on the meta device gets a real one after
        loading)."""
        head_dim, positions = self.cfg.hidden_size // self.cfg.num_heads, self.cfg.max_len
        tables = [torch.stack(rope_tables(RopeConfig(theta), head_dim, positions))
                  for theta in (self.cfg.global_theta, self.cfg.local_theta)]
        self.register_buffer("rope_table", torch.stack(tables), persistent=False)

    @property
    def classifier_pooling(self) -> str:
        return self.cfg.classifier_pooling

    def forward(self, sequences: list[list[int]], separator: int | None = None) -> Tensor:
        """Every token's final hidden state, the sequences' rows one after another (a pair
        is one sequence: `separator` is not read)."""
        device = self.word.weight.device
        tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
        x = self.embed_norm(self.word(tokens))
        table = self.rope_table[:, :, positions, None]  # (kinds, 2, tokens, 1, head_dim)
        rope = {True: (table[0, 0], table[0, 1]), False: (table[1, 0], table[1, 1])}
        lengths = [len(s) for s in sequences]
        for layer in self.layers:
            x = layer(x, lengths, rope)
        return self.final_norm(x)

    def classify(self, pooled: Tensor) -> Tensor:
        """A classifier's logits of each pooled state, float32."""
        return self.head_out(self.head_norm(self.head_act(self.head_dense(pooled)))).float()


# our parameter -> the checkpoint's, per layer ("{i}") or once
_LAYER_NAMES = {"attn_norm": "attn_norm", "qkv": "attn.Wqkv", "out": "attn.Wo",
                "mlp_norm": "mlp_norm", "up": "mlp.Wi", "down": "mlp.Wo"}
_TOP_NAMES = {"word": "embeddings.tok_embeddings", "embed_norm": "embeddings.norm",
              "final_norm": "final_norm"}
_HEAD_NAMES = {"head_dense": "head.dense", "head_norm": "head.norm", "head_out": "classifier"}


def load_modernbert(directory: Path, c: dict[str, Any], device: torch.device,
                    dtype: torch.dtype) -> tuple[ModernBert, ModernBertConfig]:
    """A ModernBERT checkpoint directory's model (config.json read as `c`), its weights on
    `device` in `dtype`; tensors under `model.` (a task model's) are read as the base's,
    an MLM head's are not read."""
    from sluice.engine.models.loader import read_safetensors

    cfg = modernbert_config(c)
    raw = read_safetensors(directory)
    weights = {k.removeprefix("model."): v for k, v in raw.items()
               if not k.startswith(("decoder.", "head.")) or cfg.classifier}
    if not cfg.classifier:
        weights = {k: v for k, v in weights.items() if not k.startswith("classifier.")}
    with torch.device("meta"):
        model = ModernBert(cfg)
    names = {**{f"{ours}.": f"{theirs}." for ours, theirs in _TOP_NAMES.items()},
             **{f"{ours}.": f"{theirs}." for ours, theirs in _HEAD_NAMES.items()},
             **{f"layers.{i}.{ours}.": f"layers.{i}.{theirs}." for i in range(cfg.num_layers)
                for ours, theirs in _LAYER_NAMES.items()}}
    state = {}
    for key in model.state_dict():
        prefix = key[:key.rindex(".") + 1]
        theirs = names[prefix] + key[len(prefix):]
        if theirs not in weights:
            raise InvalidRequestError(f"{cfg.architecture}: missing tensor {theirs!r}",
                                      param="model")
        state[key] = weights.pop(theirs).to(dtype)
    if weights:
        raise InvalidRequestError(f"{cfg.architecture}: unexpected tensors "
                                  f"{sorted(weights)[:5]}", param="model")
    model.load_state_dict(state, assign=True, strict=False)
    model.set_rope()
    return model.to(device).eval(), cfg
