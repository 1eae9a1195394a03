"""ModernBERT (sluice.engine.models.modernbert): tiny random checkpoints saved by
transformers, their states, pooled embeddings, token rows and a mean-pooling classifier's
scores checked against transformers' own, with local layers whose window is smaller than
the inputs (so the sliding mask matters), inputs of several lengths batched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .test_encoder import BERT_PAIR, BERT_SPECIALS, save_tokenizer
from .worker_helpers import ServerThread

TEXTS = ["a cat sat", "the river runs to the sea and a dog ran " * 3 + "one two three",
         "stock prices fell"]
SHAPE = dict(vocab_size=80, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, max_position_embeddings=64, local_attention=8,
             global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=2, eos_token_id=3,
             cls_token_id=2, sep_token_id=3)


def tiny_modernbert(out: Path, classifier: dict[str, Any] | None = None) -> Path:
    """A random 4-layer ModernBERT (layers 0 and 3 global, 1 and 2 local with a window of
    4 tokens either way), its weights widened so that inputs differ."""
    from transformers import (
        ModernBertConfig,
        ModernBertForSequenceClassification,
        ModernBertModel,
    )

    torch.manual_seed(7)
    config = ModernBertConfig(**SHAPE, **(classifier or {}))
    model: Any = ModernBertForSequenceClassification(config) if classifier else \
        ModernBertModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(out))
    save_tokenizer(out, BERT_SPECIALS, ("[CLS]", "[SEP]"), BERT_PAIR)
    return out


def serve(model: Path, **options: Any) -> tuple[AsyncEngine, ServerThread]:
    engine = AsyncEngine(EngineConfig.from_options(str(model), dtype="float32",
                                                   num_kv_blocks=64, block_size=16,
                                                   max_num_seqs=8, **options))
    return engine, ServerThread(build_app(engine, WorkerConfig())).start()


def test_modernbert_embeds_as_transformers(tmp_path: Path) -> None:
    """Every token's state equals transformers' `last_hidden_state` (`/pooling`'s
    token_embed, raw), MEAN pooling and the default (CLS, normalized) too, inputs of 5
    to 36 tokens in one step; generation is refused."""
    from transformers import AutoModel

    model_dir = tiny_modernbert(tmp_path / "tiny-modernbert")
    peer = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engine, server = serve(model_dir)
    try:
        tok = engine.tokenizer
        ids = [tok.encode(t) for t in TEXTS]
        assert max(len(x) for x in ids) > 9  # past a local layer's window
        with torch.no_grad():
            want = [peer(torch.tensor([x])).last_hidden_state[0] for x in ids]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/pooling", json={"input": TEXTS, "task": "token_embed",
                                            "use_activation": False})
            assert r.status_code == 200, r.text
            for item, states in zip(r.json()["data"], want, strict=True):
                np.testing.assert_allclose(item["data"], states.numpy(), atol=2e-5)
            r = http.post("/v1/embeddings", json={"input": TEXTS})
            for item, states in zip(r.json()["data"], want, strict=True):
                np.testing.assert_allclose(
                    item["embedding"], torch.nn.functional.normalize(states[0], dim=-1),
                    atol=2e-5)
            r = http.post("/v1/completions", json={"prompt": "a cat", "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_modernbert_classifier_scores_as_transformers(tmp_path: Path, pooling: str) -> None:
    """`ModernBertForSequenceClassification`: its head (dense, GELU, LayerNorm) and
    classifier over the first token's state or the mean of all (`classifier_pooling`),
    softmax over three labels, as transformers' `logits`; raw with use_activation off."""
    from transformers import AutoModelForSequenceClassification

    labels = {0: "neg", 1: "neutral", 2: "pos"}
    model_dir = tiny_modernbert(tmp_path / f"tiny-modernbert-{pooling}", dict(
        classifier_pooling=pooling, id2label=labels,
        label2id={v: k for k, v in labels.items()}))
    peer = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=torch.float32).eval()
    engine, server = serve(model_dir)
    try:
        with torch.no_grad():
            logits = [peer(torch.tensor([engine.tokenizer.encode(t)])).logits[0]
                      for t in TEXTS]
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for flag, activate in (({}, True), ({"use_activation": False}, False)):
                r = http.post("/classify", json={"input": TEXTS, **flag})
                assert r.status_code == 200, r.text
                for item, row in zip(r.json()["data"], logits, strict=True):
                    want = torch.softmax(row, -1) if activate else row
                    np.testing.assert_allclose(item["probs"], want.numpy(), atol=2e-5)
                    assert item["label"] == labels[int(row.argmax())]
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("window", [1, 4, 20])
def test_local_attention_in_blocks_equals_the_masked_whole(window: int) -> None:
    """A local layer's attention, a block of queries at a time against the keys they see,
    equals one masked call over the whole input (|i - j| <= window)."""
    from sluice.engine.models.modernbert import local_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, 37, 8) for _ in range(3))
    pos = torch.arange(37)
    mask = (pos[:, None] - pos[None, :]).abs() <= window
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    torch.testing.assert_close(local_attention(q, k, v, window), whole, atol=1e-6, rtol=1e-5)
