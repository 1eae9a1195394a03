"""A llama.cpp GGUF file of an encoder, served as the same model a checkpoint directory
gives: `general.architecture` "bert" (what llama.cpp's converter writes for BERT
checkpoints, the embedding files llama.cpp and ollama users have: all-MiniLM, bge, e5,
mxbai-embed-large, snowflake-arctic-embed; sluice.engine.models.bert) and "nomic-bert"
(nomic-embed-text v1 and v1.5, ollama's `nomic-embed-text`;
sluice.engine.models.nomic_bert).

What the converter changed is undone:

1. Names: `blk.3.attn_q.weight` -> `encoder.layer.3.attention.self.query.weight`, each
   architecture's tensors back to its checkpoint's (GGUF_ENCODER_NAMES); tensors
   dequantized to float32 (`gguf_loader.dequantize`), then cast to the engine dtype,
   once per machine: the converted tensors go to the weights cache (`weights_cache`, as
   a decoder file's state does) and a later start memory-maps them.
2. The vocabulary's spelling (word-initial pieces `▁word`, continuations without `##`):
   sluice.engine.tokenizer's `bert` tokenizer.
3. The sentence-transformers pooling became `<arch>.pooling_type` (llama.cpp's enum:
   1 MEAN, 2 CLS, 3 LAST): read back as the model's own pooler, normalized, as
   llama.cpp's embeddings are; `--pooler-config` still overrides it.

BERT's activation is its exact GELU (llama.cpp computes its tanh approximation; the
checkpoint was trained with the exact one). Refused, naming what is missing: a
cross-encoder file (`pooling_type` RANK, a `cls` head), RoBERTa files (a `gpt2`
vocabulary), and other encoder architectures (jina-bert-v2, nomic-bert-moe,
modern-bert). An XLM-RoBERTa encoder's file (bge-m3, multilingual-e5) is a `bert` file
with a `t5` vocabulary (sluice.engine.tokenizer's unigram) whose position embeddings the
converter already cut past the padding id, so it is served as a BERT.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sluice.engine.models.bert import encoder_config, encoder_from_weights
from sluice.engine.models.gguf_file import GGUFFile, read_gguf
from sluice.engine.models.nomic_bert import nomic_bert_config, nomic_bert_from_weights
from sluice.engine.pooling import Pooler
from sluice.protocol.errors import InvalidRequestError

# GGUF general.architecture -> the checkpoint architecture it is served as
GGUF_ENCODER_ARCHITECTURES = {"bert": "BertModel", "nomic-bert": "NomicBertModel"}
# per architecture: (llama.cpp's per-layer name -> the checkpoint's, the checkpoint's
# layer prefix, llama.cpp's global name -> the checkpoint's)
GGUF_ENCODER_NAMES: dict[str, tuple[dict[str, str], str, dict[str, str]]] = {
    "bert": ({"attn_q": "attention.self.query", "attn_k": "attention.self.key",
              "attn_v": "attention.self.value", "attn_output": "attention.output.dense",
              "attn_output_norm": "attention.output.LayerNorm", "ffn_up": "intermediate.dense",
              "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"},
             "encoder.layer",
             {"token_embd": "embeddings.word_embeddings",
              "position_embd": "embeddings.position_embeddings",
              "token_types": "embeddings.token_type_embeddings",
              "token_embd_norm": "embeddings.LayerNorm"}),
    "nomic-bert": ({"attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj",
                    "attn_output_norm": "norm1", "ffn_up": "mlp.fc11", "ffn_gate": "mlp.fc12",
                    "ffn_down": "mlp.fc2", "layer_output_norm": "norm2"},
                   "encoder.layers",
                   {"token_embd": "embeddings.word_embeddings",
                    "token_types": "embeddings.token_type_embeddings",
                    "token_embd_norm": "emb_ln"})}
# GGUF general.architecture -> (config.json -> its config, (config, checkpoint-named
# tensors, device, dtype) -> the model)
GGUF_ENCODER_BUILDERS: dict[str, tuple[Callable[[dict[str, Any]], Any], Callable[..., Any]]] = {
    "bert": (encoder_config, encoder_from_weights),
    "nomic-bert": (nomic_bert_config, nomic_bert_from_weights)}
# llama.cpp's enum llama_pooling_type -> sluice's pooling type (4, RANK: a cross-encoder)
POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}


def gguf_encoder_architecture(path: Path) -> str | None:
    """The checkpoint architecture a GGUF file of an encoder is served as; None for any
    other file (a decoder's)."""
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    return GGUF_ENCODER_ARCHITECTURES.get(read_gguf(path).get("general.architecture"))


def gguf_encoder_config(path: Path) -> dict[str, Any]:
    """The file's metadata as the config.json of the checkpoint it was converted from."""
    gguf = read_gguf(path)
    arch = gguf.get("general.architecture")

    def meta(key: str) -> Any:
        value = gguf.get(f"{arch}.{key}")
        if value is None:
            raise InvalidRequestError(f"{path.name}: missing GGUF metadata {arch}.{key}",
                                      param="model")
        return value

    vocabulary = gguf.get("tokenizer.ggml.model")
    if vocabulary not in ("bert", "t5") or (vocabulary == "t5" and arch != "bert"):
        raise InvalidRequestError(f"{path.name}: a GGUF {arch} file with a {vocabulary!r} "
                                  "vocabulary (RoBERTa's) is not supported; serve its "
                                  "checkpoint directory", param="model")
    if gguf.get(f"{arch}.pooling_type") == 4 or "cls.weight" in gguf.tensors:
        raise InvalidRequestError(f"{path.name}: a GGUF cross-encoder (pooling_type RANK) is "
                                  "not supported; serve its checkpoint directory", param="model")
    types = gguf.tensors.get("token_types.weight")
    config = {"architectures": [GGUF_ENCODER_ARCHITECTURES[arch]],
              "vocab_size": gguf.tensors["token_embd.weight"].shape[0],
              "hidden_size": int(meta("embedding_length")),
              "intermediate_size": int(meta("feed_forward_length")),
              "num_hidden_layers": int(meta("block_count")),
              "num_attention_heads": int(meta("attention.head_count")),
              "max_position_embeddings": int(meta("context_length")),
              "layer_norm_eps": float(meta("attention.layer_norm_epsilon")),
              "type_vocab_size": types.shape[0] if types is not None else 1}
    if arch == "nomic-bert":
        return {**config, "hidden_act": "silu", "rotary_emb_base": float(meta("rope.freq_base"))}
    return {**config, "hidden_act": "gelu"}


def load_gguf_encoder(path: Path, c: dict[str, Any], device: torch.device,
                      dtype: torch.dtype) -> tuple[Any, Any]:
    """The encoder of a GGUF file (`gguf_encoder_config(path)` as `c`, overrides applied),
    its weights dequantized to `dtype` on `device`."""
    from sluice.engine.models.gguf_loader import dequantize
    from sluice.engine.models.weights_cache import cached_state

    gguf = read_gguf(path)
    arch = gguf.get("general.architecture")
    weights = cached_state(path, dtype, lambda: {
        checkpoint_name(name, arch): dequantize(gguf, name).to(dtype) for name in gguf.tensors})
    config_of, model_of = GGUF_ENCODER_BUILDERS[arch]
    cfg = config_of(c)
    return model_of(cfg, weights, device, dtype), cfg


def checkpoint_name(gguf_name: str, arch: str = "bert") -> str:
    """`blk.3.attn_q.weight` -> `encoder.layer.3.attention.self.query.weight` (`arch`'s
    checkpoint names); a name not in the tables is kept (and reported as unexpected by
    the model's loader)."""
    layer_names, prefix, global_names = GGUF_ENCODER_NAMES[arch]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"{prefix}.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in global_names:
        return f"{global_names[parts[0]]}.{parts[1]}"
    return gguf_name


def gguf_pooler(path: Path) -> Pooler | None:
    """The pooling the file declares (`bert.pooling_type`), normalized; None where it
    declares none (or NONE, per-token outputs: the caller's default then)."""
    gguf: GGUFFile = read_gguf(path)
    kind = gguf.get(f"{gguf.get('general.architecture')}.pooling_type")
    return Pooler(POOLING_TYPES[int(kind)], True) if kind in POOLING_TYPES else None
