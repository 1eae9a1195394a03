"""Encoder-only embedding models (BERT, XLM-RoBERTa; sluice.engine.models.bert and
encoder_runner): tiny random checkpoints saved by transformers with a WordPiece
tokenizer made here, their embeddings checked against transformers' own
`last_hidden_state`, batched, at the model's longest input, pooled CLS by default and
as sentence-transformers' files or `--pooler-config` say; generation refused."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .worker_helpers import ServerThread

WORDS = ("the river runs to sea a cat sat on mat dog ran stock prices fell rose "
         "hello world token ids in out one two three").split()
MAX_POSITIONS = 64


def save_tokenizer(out: Path, specials: list[str], template: tuple[str, str],
                   pair: str) -> None:
    """A WordPiece tokenizer over WORDS and the letters, adding `template`'s first and
    last special tokens around every text (as BERT's and XLM-R's do), `pair` around two."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate([*specials, *WORDS,
                                         *"abcdefghijklmnopqrstuvwxyz.,!?"])}
    unk = next(s for s in specials if "unk" in s.lower())
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    first, last = template
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", pair=pair,
        special_tokens=[(first, vocab[first]), (last, vocab[last])])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"unk_token": unk,
                                                           "sep_token": last}))

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_PAIR = "[CLS] $A [SEP] $B:1 [SEP]:1"  # BERT's: the second text is token type 1
XLMR_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
XLMR_PAIR = "<s> $A </s> </s> $B </s>"


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def encoder_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Path:
    from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

    out = tmp_path_factory.mktemp(f"tiny-{request.param}")
    torch.manual_seed(0)
    shape = dict(vocab_size=80, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128)
    if request.param == "bert":
        model: Any = BertModel(BertConfig(max_position_embeddings=MAX_POSITIONS, **shape))
        save_tokenizer(out, BERT_SPECIALS, ("[CLS]", "[SEP]"), BERT_PAIR)
    else:  # positions start past the padding id: 2 + MAX_POSITIONS rows
        model = XLMRobertaModel(XLMRobertaConfig(max_position_embeddings=MAX_POSITIONS + 2,
                                                 pad_token_id=1, type_vocab_size=1, **shape))
        save_tokenizer(out, XLMR_SPECIALS, ("<s>", "</s>"), XLMR_PAIR)
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def states(encoder_dir: Path) -> Any:
    from transformers import AutoModel

    from sluice.engine.tokenizer import load_tokenizer

    model = AutoModel.from_pretrained(str(encoder_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(encoder_dir))

    def run(text: str) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
    return run


def normalized(row: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(row, dim=-1).numpy()


def engine_for(model: Path, **options: Any) -> AsyncEngine:
    return AsyncEngine(EngineConfig.from_options(str(model), dtype="float32", **options))


def embed_all(engine: AsyncEngine, inputs: list[Any], tag: str) -> list[Any]:
    async def run() -> list[Any]:
        return list(await asyncio.gather(*(engine.embed(x, f"{tag}-{i}")
                                           for i, x in enumerate(inputs))))
    return asyncio.run(run())


LONGEST = " ".join(WORDS * 3)[:400]  # more words than fit: cut below to the longest input


def test_encoder_embeddings_match_transformers(encoder_dir: Path, states: Any) -> None:
    """CLS pooling, normalized (the default without sentence-transformers files), for
    inputs batched in one step, the same text again (no cache hit) and an input of the
    model's whole length; MEAN through `pooler_config`."""
    engine = engine_for(encoder_dir, max_num_batched_tokens=64)
    try:
        ids = engine.tokenizer.encode(LONGEST)[:MAX_POSITIONS]
        longest = engine.tokenizer.decode(ids[1:-1])
        while len(engine.tokenizer.encode(longest)) > MAX_POSITIONS:
            longest = longest.rsplit(" ", 1)[0]
        inputs = ["a cat sat on the mat", "hello world", "one", longest, "a cat sat on the mat"]
        outs = embed_all(engine, inputs, "cls")
        for text, out in zip(inputs, outs, strict=True):
            np.testing.assert_allclose(out.outputs.embedding, normalized(states(text)[0]),
                                       atol=2e-5)
        assert all(o.num_cached_tokens == 0 for o in outs)
        assert engine.info.max_model_len == MAX_POSITIONS
        too_long = " ".join(WORDS * 4)
        with pytest.raises(InvalidRequestError, match="maximum context length"):
            embed_all(engine, [too_long], "long")
    finally:
        engine.shutdown()
    engine = engine_for(encoder_dir, pooler_config='{"pooling_type": "MEAN"}')
    try:
        out = embed_all(engine, ["the river runs to the sea"], "mean")[0]
        np.testing.assert_allclose(out.outputs.embedding,
                                   normalized(states("the river runs to the sea").mean(0)),
                                   atol=2e-5)
    finally:
        engine.shutdown()


def test_encoder_refuses_generation_over_http(encoder_dir: Path, states: Any) -> None:
    """A worker serving an encoder answers embeddings and scores; completions and chats
    are 400s naming `model`, and it keeps serving."""
    engine = engine_for(encoder_dir)
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("enc",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/embeddings", json={"input": ["a cat sat", "a dog ran"]})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                                       normalized(states("a cat sat")[0]), atol=2e-5)
            r = http.post("/v1/score", json={"text_1": "a cat sat", "text_2": ["a cat sat"]})
            assert r.status_code == 200 and abs(r.json()["data"][0]["score"] - 1) < 1e-5
            for path, body in [("/v1/completions", {"prompt": "a cat", "max_tokens": 2}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]})]:
                r = http.post(path, json={"model": "enc", **body})
                assert r.status_code == 400, (path, r.text)
                error = r.json()["error"]
                assert error["param"] == "model" and "pooling model" in error["message"]
            assert http.post("/v1/embeddings", json={"input": "still"}).status_code == 200
    finally:
        server.stop()
        engine.shutdown()


def test_encoder_refuses_what_it_lacks(encoder_dir: Path) -> None:
    for options, param in [({"enable_lora": True}, "enable_lora"),
                           ({"quantization": "int8"}, "quantization"),
                           ({"max_model_len": MAX_POSITIONS + 1}, "max_model_len")]:
        with pytest.raises(InvalidRequestError) as refused:
            engine_for(encoder_dir, **options)
        assert refused.value.param == param

    async def generate(engine: AsyncEngine) -> None:
        async for _ in engine.generate("a cat", SamplingParams(max_tokens=1), "g"):
            pass

    engine = engine_for(encoder_dir)
    try:
        with pytest.raises(InvalidRequestError, match="pooling model"):
            asyncio.run(generate(engine))
    finally:
        engine.shutdown()


def test_sentence_transformers_mean_on_an_encoder(encoder_dir: Path, tmp_path: Path,
                                                  states: Any) -> None:
    """A BERT-style checkpoint whose sentence-transformers files say mean pooling and
    normalize (all-MiniLM's, e5's shape) is pooled so without any flag."""
    import shutil

    from tiny_models import save_sentence_transformers

    out = tmp_path / "st"
    shutil.copytree(encoder_dir, out)
    save_sentence_transformers(out, {"pooling_mode_mean_tokens": True}, normalize=True)
    engine = engine_for(out)
    try:
        got = embed_all(engine, ["stock prices fell"], "st")[0].outputs.embedding
        np.testing.assert_allclose(got, normalized(states("stock prices fell").mean(0)),
                                   atol=2e-5)
    finally:
        engine.shutdown()


def classifier_checkpoint(out: Path, family: str, labels: dict[int, str], seed: int,
                          **extra: Any) -> Path:
    """A tiny random BERT or XLM-R `*ForSequenceClassification` over `labels`, its head
    rescaled so that its logits over a few pairs spread with a standard deviation of 2
    (random weights score every input alike)."""
    from tokenizers import Tokenizer
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    torch.manual_seed(seed)
    shape = dict(vocab_size=80, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, id2label=labels,
                 label2id={v: k for k, v in labels.items()}, **extra)
    if family == "bert":
        model: Any = BertForSequenceClassification(
            BertConfig(max_position_embeddings=MAX_POSITIONS, **shape))
        save_tokenizer(out, BERT_SPECIALS, ("[CLS]", "[SEP]"), BERT_PAIR)
        head = model.classifier
    else:
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
            max_position_embeddings=MAX_POSITIONS + 2, pad_token_id=1, type_vocab_size=1,
            **shape))
        save_tokenizer(out, XLMR_SPECIALS, ("<s>", "</s>"), XLMR_PAIR)
        head = model.classifier.out_proj
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    with torch.no_grad():
        logits = torch.cat([model(input_ids=torch.tensor([e.ids]),
                                  token_type_ids=torch.tensor([e.type_ids])).logits
                            for e in (tok.encode(a, b) for a in WORDS[:4] for b in WORDS[4:8])])
        scale = 2.0 / float(logits.std())
        head.weight *= scale
        head.bias.copy_(scale * (head.bias - logits.mean(0)))
    model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def cross_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> Path:
    """A one-label `*ForSequenceClassification` (a reranker's shape)."""
    return classifier_checkpoint(tmp_path_factory.mktemp(f"tiny-cross-{request.param}"),
                                 request.param, {0: "LABEL_0"}, seed=1)


def test_cross_encoder_scores_and_reranks_as_transformers(cross_dir: Path) -> None:
    """`/v1/score` and `/v1/rerank` on a cross-encoder: each pair joined by the tokenizer's
    pair template (BERT's second text as token type 1) scored sigmoid(logit) as
    transformers' model of the same checkpoint; documents ordered by it; embeddings and
    `pooler_config` refused."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForSequenceClassification

    peer = AutoModelForSequenceClassification.from_pretrained(
        str(cross_dir), dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(cross_dir / "tokenizer.json"))

    def expected(a: str, b: str) -> float:
        enc = tok.encode(a, b)
        with torch.no_grad():
            logit = peer(input_ids=torch.tensor([enc.ids]),
                         token_type_ids=torch.tensor([enc.type_ids])).logits[0, 0]
        return float(torch.sigmoid(logit))

    query = "a cat sat on the mat"
    documents = ["stock prices fell", "a dog ran", "a cat sat", "the river runs to the sea"]
    engine = engine_for(cross_dir)
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("rr",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/score", json={"text_1": query, "text_2": documents})
            assert r.status_code == 200, r.text
            got = [d["score"] for d in r.json()["data"]]
            want = [expected(query, d) for d in documents]
            np.testing.assert_allclose(got, want, atol=1e-5)
            assert np.diff(np.sort(want)).min() > 1e-4  # an order to check below
            assert r.json()["usage"]["prompt_tokens"] == sum(
                len(tok.encode(query, d).ids) for d in documents)
            r = http.post("/v1/score", json={"text_1": documents[:2],
                                             "text_2": documents[2:]})
            np.testing.assert_allclose([d["score"] for d in r.json()["data"]],
                                       [expected(documents[0], documents[2]),
                                        expected(documents[1], documents[3])], atol=1e-5)
            r = http.post("/v1/rerank", json={"query": query, "documents": documents,
                                              "top_n": 3})
            assert r.status_code == 200, r.text
            order = sorted(range(len(documents)), key=lambda i: -want[i])[:3]
            assert [x["index"] for x in r.json()["results"]] == order
            np.testing.assert_allclose([x["relevance_score"] for x in r.json()["results"]],
                                       [want[i] for i in order], atol=1e-5)
            r = http.post("/v1/embeddings", json={"input": "a cat"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "classifier" in r.json()["error"]["message"]
            r = http.post("/v1/score", json={"text_1": "", "text_2": "a cat"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
            # a long pair is tokenized off the event loop, then refused as too long
            r = http.post("/v1/rerank", json={"query": query, "documents": ["a cat " * 3000]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
            assert "maximum context length" in r.json()["error"]["message"]
            r = http.post("/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    finally:
        server.stop()
        engine.shutdown()
    with pytest.raises(InvalidRequestError) as refused:
        engine_for(cross_dir, pooler_config='{"pooling_type": "MEAN"}')
    assert refused.value.param == "pooler_config"


@pytest.fixture(scope="module", params=["bert", "xlm-roberta"])
def classifier_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Path:
    """Three labels: BERT's softmax over them, XLM-R's `multi_label_classification`."""
    extra = {} if request.param == "bert" else {"problem_type": "multi_label_classification"}
    return classifier_checkpoint(
        tmp_path_factory.mktemp(f"tiny-classifier-{request.param}"), request.param,
        {0: "negative", 1: "neutral", 2: "positive"}, seed=2, **extra)


def test_classify_answers_each_inputs_label_scores(classifier_dir: Path) -> None:
    """vLLM's `/classify` (and `/v1/classify`): each input's probabilities (a softmax, or
    each label's sigmoid for a multi-label model) as transformers computes them, the
    best label's name and the label count; pairs are refused (three labels are no one
    score), and so is `/classify` on an embedding model."""
    from transformers import AutoModelForSequenceClassification

    peer = AutoModelForSequenceClassification.from_pretrained(
        str(classifier_dir), dtype=torch.float32).eval()
    multi = peer.config.problem_type == "multi_label_classification"
    engine = engine_for(classifier_dir)
    texts = ["a cat sat on the mat", "stock prices fell", "hello world"]
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("cls",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for path in ("/classify", "/v1/classify"):
                r = http.post(path, json={"model": "cls", "input": texts})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["object"] == "list" and body["id"].startswith("classify-")
                for i, (text, data) in enumerate(zip(texts, body["data"], strict=True)):
                    ids = engine.tokenizer.encode(text)
                    with torch.no_grad():
                        logits = peer(torch.tensor([ids])).logits[0]
                    want = torch.sigmoid(logits) if multi else torch.softmax(logits, -1)
                    np.testing.assert_allclose(data["probs"], want.numpy(), atol=1e-5)
                    assert data["index"] == i and data["num_classes"] == 3
                    assert data["label"] == peer.config.id2label[int(want.argmax())]
                assert body["usage"]["prompt_tokens"] == sum(
                    len(engine.tokenizer.encode(t)) for t in texts)
            r = http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
            assert r.status_code == 400 and "3 labels" in r.json()["error"]["message"]
            r = http.post("/classify", json={"input": []})
            assert r.status_code == 400 and r.json()["error"]["param"] == "input"
            r = http.post("/classify", json={"input": "a", "top_k": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    finally:
        server.stop()
        engine.shutdown()


def test_classify_on_an_embedding_model_is_refused(encoder_dir: Path) -> None:
    engine = engine_for(encoder_dir)
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("enc",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/classify", json={"input": "a cat"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "not a classification model" in r.json()["error"]["message"]
    finally:
        server.stop()
        engine.shutdown()


def test_offline_llm_classifies_and_scores(cross_dir: Path, classifier_dir: Path,
                                           encoder_dir: Path) -> None:
    """vLLM's `LLM.classify` and `LLM.score` on the same models as the routes above: the
    same numbers as `/classify` and `/v1/score` give; each refused where it has no
    meaning (an embedding model classifies nothing, a classifier embeds nothing)."""
    from sluice.engine.llm import LLM

    cross = LLM(str(cross_dir), dtype="float32")
    try:
        pairs = cross.score("a cat sat on the mat", ["a cat sat", "stock prices fell"])
        engine = engine_for(cross_dir)
        server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("r",)))).start()
        try:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                r = http.post("/v1/score", json={"text_1": "a cat sat on the mat",
                                                 "text_2": ["a cat sat", "stock prices fell"]})
            np.testing.assert_allclose([p.outputs.score for p in pairs],
                                       [d["score"] for d in r.json()["data"]], atol=1e-6)
        finally:
            server.stop()
            engine.shutdown()
        with pytest.raises(InvalidRequestError, match="classifier"):
            cross.embed(["a cat"])
    finally:
        cross.shutdown()
    classifier = LLM(str(classifier_dir), dtype="float32")
    try:
        out = classifier.classify(["a cat sat", "hello world"])
        assert [len(o.outputs.probs) for o in out] == [3, 3]
        assert out[0].outputs.num_classes == 3
        with pytest.raises(InvalidRequestError, match="3 labels"):
            classifier.score("a", "b")
    finally:
        classifier.shutdown()
    embedder = LLM(str(encoder_dir), dtype="float32")
    try:
        with pytest.raises(InvalidRequestError, match="not a classification model"):
            embedder.classify(["a cat"])
        assert abs(embedder.score("a cat", "a cat")[0].outputs.score - 1.0) < 1e-5
    finally:
        embedder.shutdown()
