"""Encoder-only models: BERT, RoBERTa and XLM-RoBERTa, as embedding models (BAAI's bge,
intfloat's e5, sentence-transformers' MiniLM, bge-m3's dense vectors) and as classifiers
(`*ForSequenceClassification`): classifier(tanh(dense(first token's state))) through a
sigmoid (one label: a cross-encoder's score of a pair, bge-reranker, ms-marco-MiniLM;
or `problem_type` multi_label_classification) or a softmax over the labels (the core's
`pooling.label_scores`, unless the request turns the activation off).

    embeddings  LayerNorm(word + absolute position + token type 0)
    each layer  x = LayerNorm(x + out(attention(q, k, v)))   every token sees every token
                x = LayerNorm(x + down(act(up(x))))          of its own sequence (no mask)

Post-norm blocks, biases on every linear and norm, no KV cache: a sequence is encoded
whole in one step (the engine turns chunked prefill and prefix caching off for these,
sluice.engine.encoder_runner). RoBERTa's positions start past its padding id
(`pad_token_id + 1`), so it serves `max_position_embeddings - pad_token_id - 1` tokens.
Token types: 0, except in a pair for a model with two types (BERT's cross-encoders),
where the tokens after the first separator are type 1 (`[CLS] a [SEP]` 0, `b [SEP]` 1:
what BERT's tokenizer gives a pair).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sluice.protocol.errors import InvalidRequestError

# config.json's `architectures` -> (positions start past the padding id: RoBERTa's,
# a classifier on the first token's state: `*ForSequenceClassification`)
ENCODER_ARCHITECTURES = {
    "BertModel": (False, False), "RobertaModel": (True, False),
    "XLMRobertaModel": (True, False), "BertForSequenceClassification": (False, True),
    "RobertaForSequenceClassification": (True, True),
    "XLMRobertaForSequenceClassification": (True, True)}
ACTIVATIONS = {"gelu": lambda x: nn.functional.gelu(x),
                "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
                "relu": nn.functional.relu, "silu": nn.functional.silu}
# BERT's pooler (a cross-encoder's head reads it) and MLM heads: not embeddings
_IGNORED = ("pooler.", "lm_head.", "cls.")


@dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_norm_eps: float
    activation: str
    position_offset: int  # RoBERTa's pad_token_id + 1; 0 for BERT
    type_vocab_size: int = 1
    labels: tuple[str, ...] = ()  # a classifier's (config.json's id2label), in id order
    multi_label: bool = False  # each label's own sigmoid (else a softmax over them)
    # an embedding model trained to be cut (as LlamaConfig's): None, () any, or the sizes
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def classifier(self) -> bool:
        return bool(self.labels)

    @property
    def max_len(self) -> int:
        return self.max_position_embeddings - self.position_offset



def encoder_config(c: dict[str, Any]) -> EncoderConfig:
    """config.json -> EncoderConfig; refuses what is not built, naming it."""
    from sluice.engine.models.loader import _matryoshka, classifier_labels

    arch = c["architectures"][0]
    kind = c.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise InvalidRequestError(f"{arch}: position_embedding_type {kind!r} is not supported "
                                  "(absolute only)", param="model")
    act = c.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise InvalidRequestError(f"{arch}: hidden_act {act!r} is not supported "
                                  f"({', '.join(ACTIVATIONS)})", param="model")
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise InvalidRequestError(f"{arch}: a decoder or cross-attention configuration is not "
                                  "an encoder", param="model")
    roberta, classifier = ENCODER_ARCHITECTURES[arch]
    labels = classifier_labels(c) if classifier else ()
    offset = int(c.get("pad_token_id", 1)) + 1 if roberta else 0
    return EncoderConfig(arch, int(c["vocab_size"]), int(c["hidden_size"]),
                         int(c["intermediate_size"]), int(c["num_hidden_layers"]),
                         int(c["num_attention_heads"]), int(c["max_position_embeddings"]),
                         float(c.get("layer_norm_eps", 1e-12)), act, offset,
                         int(c.get("type_vocab_size", 1)), labels,
                         c.get("problem_type") == "multi_label_classification",
                         None if classifier else _matryoshka(c))


class Linear(nn.Linear):
    """nn.Linear whose matmul can be replaced (`Encoder.use_matmul`: oneDNN's on a packed
    weight, sluice.engine.native.PackedLinear)."""

    matmul: Callable[[Tensor, Tensor, Tensor | None], Tensor] = staticmethod(  # type: ignore[assignment]
        nn.functional.linear)

    def forward(self, x: Tensor) -> Tensor:
        return self.matmul(x, self.weight, self.bias)


def use_matmul(model: nn.Module, make: Callable[[Tensor], Callable[
        [Tensor, Tensor, Tensor | None], Tensor]]) -> None:
    """Each of `model`'s linears' matmul made from its weight (`make(weight)`)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.matmul = make(module.weight)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads = cfg.num_heads
        self.qkv = Linear(h, 3 * h)  # query, key, value stacked at load
        self.out = Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=eps)
        self.up = Linear(h, cfg.intermediate_size)
        self.down = Linear(cfg.intermediate_size, h)
        self.output_norm = nn.LayerNorm(h, eps=eps)
        self.act = ACTIVATIONS[cfg.activation]

    def forward(self, x: Tensor, lengths: list[int]) -> Tensor:
        heads, hidden = self.num_heads, x.shape[-1]
        q, k, v = self.qkv(x).view(-1, 3, heads, hidden // heads).unbind(1)
        parts = []
        start = 0
        for n in lengths:  # each sequence attends within itself, all ways; 4-D inputs
            rows = slice(start, start + n)  # take torch's fused CPU kernel (3-D: the math)
            q1, k1, v1 = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            parts.append(nn.functional.scaled_dot_product_attention(q1, k1, v1)[0]
                         .transpose(0, 1).reshape(n, hidden))
            start += n
        x = self.attention_norm(x + self.out(torch.cat(parts)))
        return self.output_norm(x + self.down(self.act(self.up(x))))


class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word = nn.Embedding(cfg.vocab_size, h)
        self.position = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type = nn.Embedding(max(cfg.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        if cfg.classifier:  # BERT's pooler + classifier, RoBERTa's classifier head
            self.head_dense = Linear(h, h)
            self.head_out = Linear(h, len(cfg.labels))

    use_matmul = use_matmul
    classifier_pooling = "cls"  # the classifier's head reads the first token's state

    def forward(self, sequences: list[list[int]], separator: int | None = None) -> Tensor:
        """Every token's final hidden state, the sequences' rows one after another;
        `separator`: the token id after whose first occurrence a pair's second text
        starts (type 1), where the model has two token types."""
        device = self.word.weight.device
        tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        offset = self.cfg.position_offset
        positions = torch.cat([torch.arange(offset, offset + len(s), device=device)
                               for s in sequences])
        types = torch.tensor([t for s in sequences for t in _token_types(s, separator)],
                             dtype=torch.long, device=device) \
            if separator is not None and self.cfg.type_vocab_size > 1 else \
            torch.zeros_like(tokens)
        x = self.embed_norm(self.word(tokens) + self.position(positions) + self.token_type(types))
        lengths = [len(s) for s in sequences]
        for layer in self.layers:
            x = layer(x, lengths)
        return x

    def classify(self, first: Tensor) -> Tensor:
        """A classifier's logits of each input from its first token's state (or each
        token's, for a token task), float32 (the core's `label_scores` turns them into
        scores)."""
        return self.head_out(torch.tanh(self.head_dense(first))).float()


def _token_types(ids: list[int], separator: int) -> list[int]:
    cut = ids.index(separator) + 1 if separator in ids else len(ids)
    return [0] * cut + [1] * (len(ids) - cut)


# our parameter -> the checkpoint's, per layer ("{i}") or once
_LAYER_NAMES = {
    "out": "attention.output.dense", "attention_norm": "attention.output.LayerNorm",
    "up": "intermediate.dense", "down": "output.dense", "output_norm": "output.LayerNorm"}
_TOP_NAMES = {"word": "embeddings.word_embeddings", "position": "embeddings.position_embeddings",
              "embed_norm": "embeddings.LayerNorm"}


def load_encoder(directory: Path, c: dict[str, Any], device: torch.device,
                 dtype: torch.dtype) -> tuple[Encoder, EncoderConfig]:
    """The encoder of a checkpoint directory (config.json already read as `c`), its
    weights on `device` in `dtype`. Tensors may sit under `bert.` or `roberta.` (a
    checkpoint saved from a task model); the pooler and MLM heads are not read."""
    from sluice.engine.models.loader import read_safetensors

    cfg = encoder_config(c)
    return encoder_from_weights(cfg, read_safetensors(directory), device, dtype), cfg


def encoder_from_weights(cfg: EncoderConfig, raw: dict[str, Tensor], device: torch.device,
                         dtype: torch.dtype) -> Encoder:
    """The encoder of `cfg` from a checkpoint's tensors under their Hugging Face names
    (a directory's safetensors, or a GGUF file's renamed: sluice.engine.models.gguf_encoder)."""
    prefixes = [p for p in ("bert.", "roberta.") if any(k.startswith(p) for k in raw)]
    weights = {k.removeprefix(prefixes[0]) if prefixes else k: v for k, v in raw.items()}
    head = {}
    if cfg.classifier:
        names = ("pooler.dense", "classifier") if "classifier.weight" in weights \
            else ("classifier.dense", "classifier.out_proj")
        for ours, theirs in zip(("head_dense", "head_out"), names, strict=True):
            for kind in ("weight", "bias"):
                if f"{theirs}.{kind}" not in weights:
                    raise InvalidRequestError(f"{cfg.architecture}: missing tensor "
                                              f"'{theirs}.{kind}'", param="model")
                head[f"{ours}.{kind}"] = weights.pop(f"{theirs}.{kind}")
    weights = {k: v for k, v in weights.items() if not k.startswith(_IGNORED)
               and not k.endswith("position_ids")}

    def take(name: str) -> Tensor:
        if name not in weights:
            raise InvalidRequestError(f"{cfg.architecture}: missing tensor {name!r}",
                                      param="model")
        return weights.pop(name)

    state: dict[str, Tensor] = {}
    for ours, theirs in _TOP_NAMES.items():
        for kind in ("weight", "bias") if ours == "embed_norm" else ("weight",):
            state[f"{ours}.{kind}"] = take(f"{theirs}.{kind}")
    types = weights.pop("embeddings.token_type_embeddings.weight", None)
    state["token_type.weight"] = types[:max(cfg.type_vocab_size, 1)] if types is not None \
        else torch.zeros(max(cfg.type_vocab_size, 1), cfg.hidden_size)
    state.update(head)
    for i in range(cfg.num_layers):
        pre = f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            state[f"layers.{i}.qkv.{kind}"] = torch.cat(
                [take(f"{pre}attention.self.{p}.{kind}") for p in ("query", "key", "value")])
            for ours, theirs in _LAYER_NAMES.items():
                state[f"layers.{i}.{ours}.{kind}"] = take(f"{pre}{theirs}.{kind}")
    if weights:
        raise InvalidRequestError(f"{cfg.architecture}: unexpected tensors "
                                  f"{sorted(weights)[:5]}", param="model")
    with torch.device("meta"):
        model = Encoder(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.to(device).eval()
