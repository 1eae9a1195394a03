"""NomicBERT (sluice.engine.models.nomic_bert) in its three spellings: transformers' own
`NomicBertModel` checkpoint, the same weights as nomic's released checkpoints spell them
(nomic's config keys and tensor names, sentence-transformers' mean pooling), and that
checkpoint written as llama.cpp's converter writes a `nomic-bert` GGUF file; against
transformers' forward, and the GGUF file against llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice.engine.models.nomic_bert import nomic_bert_config
from sluice.engine.tokenizer import load_tokenizer
from sluice.protocol.errors import InvalidRequestError
from tiny_models import (
    bert_vocabulary,
    save_bert_tokenizer,
    save_sentence_transformers,
    write_bert_gguf,
)

from .worker_helpers import embed_texts

TEXTS = ["a cat sat on the mat", "The Rivers RUNNING to the sea!", "hello, world... dogs",
         "stock prices fell 3%", " ".join(["the river runs to the sea"] * 6)]
MAX_POSITIONS = 64
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers' NomicBertModel, random (seed 5), RoPE base 1,000 as released, its
    tensors under transformers' own names (`save_pretrained` writes nomic's)."""
    from safetensors.torch import save_file
    from transformers import NomicBertConfig, NomicBertModel

    out = tmp_path_factory.mktemp("nomic-native")
    vocabulary = bert_vocabulary()
    torch.manual_seed(5)
    config = NomicBertConfig(vocab_size=len(vocabulary), max_position_embeddings=MAX_POSITIONS,
                             **SHAPE)
    model = NomicBertModel(config)
    model.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(out / "model.safetensors"))
    save_bert_tokenizer(out, vocabulary)
    return out


@pytest.fixture(scope="module")
def released_dir(native_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as nomic-embed-text's checkpoints spell them: nomic's config keys,
    `encoder.layers.N.attn.Wqkv` (Q, K, V stacked), `mlp.fc11` (up) / `fc12` (gate) /
    `fc2`, `norm1` / `norm2`, `emb_ln`; sentence-transformers' mean pooling, normalized."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nomic-released")
    weights = load_file(str(native_dir / "model.safetensors"))
    renamed = {}
    for name, tensor in weights.items():
        name = name.replace("embeddings.LayerNorm", "emb_ln")
        for ours, theirs in [("self_attn.o_proj", "attn.out_proj"), ("mlp.up_proj", "mlp.fc11"),
                             ("mlp.gate_proj", "mlp.fc12"), ("mlp.down_proj", "mlp.fc2"),
                             ("post_attention_layernorm", "norm1"),
                             ("post_mlp_layernorm", "norm2"), ("layers.", "encoder.layers.")]:
            name = name.replace(ours, theirs)
        renamed[name] = tensor
    for i in range(SHAPE["num_hidden_layers"]):
        pre = f"encoder.layers.{i}.self_attn."
        renamed[f"encoder.layers.{i}.attn.Wqkv.weight"] = torch.cat(
            [renamed.pop(f"{pre}{p}_proj.weight") for p in "qkv"])
    save_file(renamed, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert",
        "vocab_size": len(bert_vocabulary()), "n_embd": SHAPE["hidden_size"],
        "n_layer": SHAPE["num_hidden_layers"], "n_head": SHAPE["num_attention_heads"],
        "n_inner": SHAPE["intermediate_size"], "n_positions": 4 * MAX_POSITIONS,
        "max_trained_positions": MAX_POSITIONS,
        "layer_norm_epsilon": 1e-12, "type_vocab_size": 2, "activation_function": "swiglu",
        "rotary_emb_base": 1000, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
        "rotary_scaling_factor": None, "prenorm": False, "qkv_proj_bias": False,
        "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(native_dir / name, out / name)
    save_sentence_transformers(out, {"pooling_mode_mean_tokens": True}, normalize=True,
                               dimension=SHAPE["hidden_size"])
    return out


def reference(native_dir: Path, texts: list[str]) -> list[np.ndarray]:
    """transformers' NomicBertModel: each text's mean state, normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(native_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(native_dir))
    rows = []
    with torch.no_grad():
        for text in texts:
            hidden = model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
    return rows


def test_nomic_bert_checkpoints_embed_as_transformers(native_dir: Path,
                                                      released_dir: Path) -> None:
    """transformers' spelling (mean pooling asked by `pooler_config`) and nomic's (its
    sentence-transformers files' mean; `max_trained_positions` the context, not the
    larger `n_positions`): every input within 2e-5 of transformers' forward, batched in
    one step."""
    released = json.loads((released_dir / "config.json").read_text())
    assert nomic_bert_config(released).max_len == MAX_POSITIONS  # its trained positions
    expected = reference(native_dir, TEXTS)
    for model, options in [(native_dir, {"pooler_config": '{"pooling_type": "MEAN"}'}),
                           (released_dir, {})]:
        for out, row in zip(embed_texts(model, TEXTS, **options), expected, strict=True):
            np.testing.assert_allclose(out, row, atol=2e-5)


def test_nomic_bert_gguf_as_transformers_and_llama_cpp(native_dir: Path, released_dir: Path,
                                                       tmp_path: Path) -> None:
    """The released spelling written as a `nomic-bert` GGUF (MEAN pooling, RoPE base in
    `rope.freq_base`): within 2e-5 of transformers, and llama.cpp on the same file gives
    the same token ids and vectors within 1e-5."""
    import llama_cpp

    path = write_bert_gguf(released_dir, tmp_path / "nomic.gguf", pooling=1,
                           arch="nomic-bert")
    ours = embed_texts(path, TEXTS)
    for out, row in zip(ours, reference(native_dir, TEXTS), strict=True):
        np.testing.assert_allclose(out, row, atol=2e-5)
    peer = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=MAX_POSITIONS,
                           n_threads=1, verbose=False)
    tokenizer = load_tokenizer(str(path))
    try:
        for text, out in zip(TEXTS, ours, strict=True):
            assert peer.tokenize(text.encode(), add_bos=True, special=True) == \
                tokenizer.encode(text), text
            np.testing.assert_allclose(out, peer.embed(text, normalize=True), atol=1e-5)
    finally:
        peer.close()


@pytest.mark.parametrize("key, value", [("rotary_emb_fraction", 0.5),
                                        ("rotary_emb_interleaved", True),
                                        ("rotary_scaling_factor", 2.0), ("prenorm", True),
                                        ("qkv_proj_bias", True),
                                        ("activation_function", "gelu")])
def test_nomic_bert_refuses_what_it_lacks(released_dir: Path, key: str, value: Any) -> None:
    config = json.loads((released_dir / "config.json").read_text())
    with pytest.raises(InvalidRequestError, match=key.split("_")[0]) as info:
        nomic_bert_config({**config, key: value})
    assert info.value.param == "model"
