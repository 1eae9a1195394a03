"""GTE's NewModel (sluice.engine.models.gte) in its two spellings, the released
checkpoints' (Alibaba's `NewModel`: stacked `qkv_proj` and `up_gate_proj`, `attn_ln`,
`mlp_ln`, their config keys and sentence-transformers files) and transformers' own
`GteModel`'s, with and without token types, against transformers' forward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sluice.engine.models.gte import gte_config
from sluice.engine.tokenizer import load_tokenizer
from sluice.protocol.errors import InvalidRequestError
from tiny_models import bert_vocabulary, save_bert_tokenizer, save_sentence_transformers

from .worker_helpers import embed_texts

TEXTS = ["a cat sat on the mat", "The Rivers RUNNING to the sea!", "hello, world... dogs",
         " ".join(["stock prices fell"] * 8)]
MAX_POSITIONS = 64


@pytest.fixture(scope="module", params=[1, 0], ids=["token-types", "no-token-types"])
def gte_dirs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, Path]:
    """transformers' GteModel (random, seed 7; `type_vocab_size` 1, or 0 as
    gte-base-en-v1.5) under its own tensor names, and the same weights as the released
    checkpoints spell them (what `save_pretrained` writes) with their config keys."""
    from safetensors.torch import save_file
    from transformers import GteConfig, GteModel

    native = tmp_path_factory.mktemp("gte-native")
    released = tmp_path_factory.mktemp("gte-released")
    vocabulary = bert_vocabulary()
    torch.manual_seed(7)
    model = GteModel(GteConfig(vocab_size=len(vocabulary), hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=96,
                               max_position_embeddings=MAX_POSITIONS,
                               type_vocab_size=request.param))
    model.save_pretrained(str(native))
    model.save_pretrained(str(released))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(native / "model.safetensors"))
    config = json.loads((native / "config.json").read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    (released / "config.json").write_text(json.dumps({
        **config, "architectures": ["NewModel"], "model_type": "new", "rope_theta": theta,
        "rope_scaling": None, "position_embedding_type": "rope", "layer_norm_type": "layer_norm",
        "pack_qkv": True, "unpad_inputs": False}))
    save_sentence_transformers(released, {"pooling_mode_cls_token": True}, normalize=True)
    for out in (native, released):
        save_bert_tokenizer(out, vocabulary)
    return native, released


def test_gte_embeds_as_transformers(gte_dirs: tuple[Path, Path]) -> None:
    """Both spellings, CLS pooled and normalized (the released sentence-transformers
    files'; the encoder default for the other): within 2e-5 of transformers' GteModel,
    inputs batched in one step."""
    from transformers import AutoModel

    native, released = gte_dirs
    model = AutoModel.from_pretrained(str(native), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(native))
    with torch.no_grad():
        expected = [torch.nn.functional.normalize(
            model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0, 0], dim=-1).numpy()
            for t in TEXTS]
    for directory in (native, released):
        for out, row in zip(embed_texts(directory, TEXTS), expected, strict=True):
            np.testing.assert_allclose(out, row, atol=2e-5)


@pytest.mark.parametrize("key, value", [("rope_scaling", {"type": "ntk", "factor": 2.0}),
                                        ("position_embedding_type", "absolute"),
                                        ("layer_norm_type", "rms_norm"),
                                        ("hidden_act", "swish-ish")])
def test_gte_refuses_what_it_lacks(gte_dirs: tuple[Path, Path], key: str, value: Any) -> None:
    config = json.loads((gte_dirs[1] / "config.json").read_text())
    with pytest.raises(InvalidRequestError, match=key) as info:
        gte_config({**config, key: value})
    assert info.value.param == "model"
