"""Pooling types for embeddings (sluice.engine.pooling): `--pooler-config` and a
checkpoint's sentence-transformers files choose LAST, MEAN or CLS and whether vectors
are normalized; checked against transformers' final hidden states of the tiny random
Llama in float32, through long prompts that run in chunks and prompts whose prefix is
cached."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.config import EngineConfig
from sluice.engine.pooling import Pooler, parse_pooler_config, resolve_pooler
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.errors import InvalidRequestError
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .conftest import TINY_OPTIONS
from .worker_helpers import ServerThread

LONG = "the river runs to the sea " * 90  # ~540 tokens: two chunks of the 512 budget
SHARED = "a prefix every input here shares, long enough for full blocks " * 4


@pytest.fixture(scope="module")
def states(tiny_llama_dir: Path) -> Any:
    """Text or ids -> transformers' final hidden states (after the last norm), float32."""
    from transformers import AutoModel

    from sluice.engine.tokenizer import load_tokenizer

    model = AutoModel.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(tiny_llama_dir))

    def run(text_or_ids: str | list[int]) -> torch.Tensor:
        ids = tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return run


def expected(hidden: torch.Tensor, kind: str, normalize: bool) -> np.ndarray:
    row = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(0)}[kind]
    return (torch.nn.functional.normalize(row, dim=-1) if normalize else row).numpy()


def engine_for(model: Path, **options: Any) -> AsyncEngine:
    return AsyncEngine(EngineConfig.from_options(str(model), dtype="float32",
                                                 **{**TINY_OPTIONS, **options}))


def embed_all(engine: AsyncEngine, inputs: list[Any], tag: str) -> list[Any]:
    async def run() -> list[Any]:
        return list(await asyncio.gather(*(engine.embed(x, f"{tag}-{i}")
                                           for i, x in enumerate(inputs))))
    return asyncio.run(run())


@pytest.mark.parametrize("kind, normalize", [("MEAN", True), ("CLS", False),
                                             ("MEAN", False)])
def test_pooling_types_match_transformers(tiny_llama_dir: Path, states: Any, kind: str,
                                          normalize: bool) -> None:
    """Each input's vector is the pooled final hidden states: a long prompt pooled over its
    chunks, short ones and ids batched in the same steps; the same text again (its blocks
    cached by the first run, and by a LAST-pooled generation) computes its whole prompt and
    gives the same vector; generation beside it is unchanged."""
    engine = engine_for(tiny_llama_dir, pooler_config=json.dumps(
        {"pooling_type": kind, "use_activation": normalize}))
    try:
        inputs: list[Any] = [LONG, "hello world", [5, 6, 7], "x", SHARED + "one"]
        outs = embed_all(engine, inputs, "first")
        for x, out in zip(inputs, outs, strict=True):
            np.testing.assert_allclose(out.outputs.embedding,
                                       expected(states(x), kind, normalize), atol=2e-5)
        again = embed_all(engine, [LONG, SHARED + "two"], "again")
        assert [o.num_cached_tokens for o in again] == [0, 0]  # never a cache hit
        np.testing.assert_allclose(again[0].outputs.embedding, outs[0].outputs.embedding,
                                   atol=1e-6)
        np.testing.assert_allclose(again[1].outputs.embedding,
                                   expected(states(SHARED + "two"), kind, normalize), atol=2e-5)

        async def generate() -> Any:
            params = SamplingParams(max_tokens=4, temperature=0.0)
            async for out in engine.generate(SHARED + "three", params, "gen"):
                last = out
            return last
        # generation still hits the blocks the embeddings cached
        assert asyncio.run(generate()).num_cached_tokens > 0
    finally:
        engine.shutdown()


def test_pooling_over_http_and_the_default_is_last(tiny_llama_dir: Path, states: Any) -> None:
    """`/v1/embeddings` on a worker with `pooler_config` CLS (not normalized); the same
    worker's score is the cosine of those vectors (not their dot product)."""
    engine = engine_for(tiny_llama_dir, pooler_config='{"pooling_type": "cls", "normalize": false}')
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/embeddings", json={"input": ["a cat sat", LONG]})
            assert r.status_code == 200, r.text
            for text, data in zip(["a cat sat", LONG], r.json()["data"], strict=True):
                np.testing.assert_allclose(data["embedding"],
                                           expected(states(text), "CLS", False), atol=2e-5)
            a, b = (expected(states(t), "CLS", False) for t in ("a cat sat", "the sea"))
            r = http.post("/v1/score", json={"text_1": "a cat sat",
                                             "text_2": ["a cat sat", "the sea"]})
            np.testing.assert_allclose(
                [d["score"] for d in r.json()["data"]],
                [1.0, a @ b / np.linalg.norm(a) / np.linalg.norm(b)], atol=1e-5)
    finally:
        server.stop()
        engine.shutdown()
    assert resolve_pooler(tiny_llama_dir, {}) == Pooler("LAST", True)


def sentence_transformers_copy(source: Path, out: Path, pooling: dict[str, bool],
                               normalize: bool) -> Path:
    """`source`'s files with sentence-transformers' modules.json and Pooling config."""
    from tiny_models import save_sentence_transformers

    shutil.copytree(source, out)
    save_sentence_transformers(out, pooling, normalize)
    return out


def test_sentence_transformers_files_choose_and_the_flag_overrides(
        tiny_llama_dir: Path, tmp_path: Path, states: Any) -> None:
    """A checkpoint with sentence-transformers' files is pooled as they say (mean, no
    Normalize module: unnormalized), as vLLM reads them; `--pooler-config` replaces the
    fields it names; a pooling mode sluice lacks (max) is refused at start unless the flag
    chooses the type."""
    mean = sentence_transformers_copy(tiny_llama_dir, tmp_path / "st-mean",
                                      {"pooling_mode_mean_tokens": True}, normalize=False)
    assert resolve_pooler(mean, {}) == Pooler("MEAN", False)
    assert resolve_pooler(mean, {"normalize": True}) == Pooler("MEAN", True)
    assert resolve_pooler(mean, {"pooling_type": "CLS"}) == Pooler("CLS", False)
    normalized = sentence_transformers_copy(tiny_llama_dir, tmp_path / "st-last",
                                            {"pooling_mode_lasttoken": True}, normalize=True)
    assert resolve_pooler(normalized, {}) == Pooler("LAST", True)
    engine = engine_for(mean)
    try:
        out = embed_all(engine, ["hello world"], "st")[0]
        np.testing.assert_allclose(out.outputs.embedding,
                                   expected(states("hello world"), "MEAN", False), atol=2e-5)
    finally:
        engine.shutdown()
    maxed = sentence_transformers_copy(tiny_llama_dir, tmp_path / "st-max",
                                       {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(InvalidRequestError, match="pooling_mode_max_tokens") as refused:
        resolve_pooler(maxed, {})
    assert refused.value.param == "model" and "--pooler-config" in refused.value.message
    assert resolve_pooler(maxed, {"pooling_type": "LAST"}) == Pooler("LAST", True)


@pytest.mark.parametrize("text, words", [
    ('{"pooling_type": "MAX"}', "pooling_type must be one of"),
    ('{"pooling_type": "STEP"}', "pooling_type must be one of"),
    ('{"normalize": "yes"}', "normalize must be true or false"),
    ('{"use_activation": true, "normalize": false}', "disagree"),
    ('{"softmax": true}', "unsupported field(s) ['softmax']"),
    ('["MEAN"]', "must be a JSON object"),
    ("{", "is not valid JSON"),
])
def test_bad_pooler_config_is_refused_naming_it(text: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        EngineConfig.from_options(None, pooler_config=text)
    assert refused.value.param == "pooler_config" and words in refused.value.message
    assert parse_pooler_config('{"pooling_type": "mean", "normalize": false}') == \
        {"pooling_type": "MEAN", "normalize": False}


def test_worker_cli_refuses_a_bad_pooler_config() -> None:
    """`sluice worker --pooler-config` with a type it lacks exits at once, naming it."""
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "worker", "--pooler-config",
                           '{"pooling_type": "ALL"}', "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "pooling_type must be one of LAST, MEAN, CLS" in done.stderr + done.stdout


def test_offline_llm_takes_pooler_config_as_a_dict(tiny_llama_dir: Path, states: Any) -> None:
    """`LLM(pooler_config={...})`, as vLLM's LLM takes it."""
    from sluice.engine.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    out = llm.embed(["hello world"])[0]
    np.testing.assert_allclose(out.outputs.embedding,
                               expected(states("hello world"), "MEAN", False), atol=2e-5)
    # `LLM.score` is the cosine of the (here unnormalized) vectors, one against each
    a, b = (expected(states(t), "MEAN", False) for t in ("hello world", "a cat sat"))
    scores = [o.outputs.score for o in llm.score("hello world", ["hello world", "a cat sat"])]
    np.testing.assert_allclose(scores, [1.0, a @ b / np.linalg.norm(a) / np.linalg.norm(b)],
                               atol=1e-5)
    with pytest.raises(InvalidRequestError, match="not a classification model"):
        llm.classify(["hello"])


def tiny_transformers_model(out: Path, auto_class: Any, model_type: str, seed: int,
                            **config: Any) -> Path:
    """A tiny random 2-layer `model_type` checkpoint built by transformers' `auto_class`
    (`config` over the common shape), its weights widened so that inputs differ, with
    SmolLM2's tokenizer."""
    from transformers import AutoConfig

    from tiny_models import save_smollm2_tokenizer

    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = auto_class.from_config(AutoConfig.for_model(model_type, **{**shape, **config}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    save_smollm2_tokenizer(out)
    return out


def decoder_classifier(out: Path, arch: str, labels: dict[int, str], **extra: Any) -> Path:
    """A tiny random `<arch>ForSequenceClassification` (a `score` head over the last
    token's state)."""
    from transformers import AutoModelForSequenceClassification

    return tiny_transformers_model(
        out, AutoModelForSequenceClassification, arch, seed=3, tie_word_embeddings=True,
        id2label=labels, label2id={v: k for k, v in labels.items()}, **extra)


@pytest.mark.parametrize("arch, labels, extra", [
    ("qwen2", {0: "negative", 1: "neutral", 2: "positive"}, {}),
    ("llama", {0: "toxic", 1: "spam"}, {"problem_type": "multi_label_classification"}),
    ("llama", {0: "relevant"}, {}),
])
def test_decoder_classifiers_classify_and_score_pairs(tmp_path: Path, arch: str,
                                                      labels: dict[int, str],
                                                      extra: dict[str, Any]) -> None:
    """`Qwen2ForSequenceClassification` and `LlamaForSequenceClassification` (reward and
    classifier models): `/classify` answers transformers' probabilities from the `score`
    head on the last token (a prompt longer than a step's budget too, in chunks); one
    label scores pairs on `/v1/score` (the two texts joined as the tokenizer joins a
    pair); generation and embeddings are refused."""
    from transformers import AutoModelForSequenceClassification

    model_dir = decoder_classifier(tmp_path / f"tiny-{arch}-classifier", arch, labels, **extra)
    peer = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=torch.float32).eval()
    engine = engine_for(model_dir)
    texts = ["hello world", LONG, "a cat sat on the mat"]

    def expected(ids: list[int], activation: bool = True) -> np.ndarray:
        with torch.no_grad():
            logits = peer(torch.tensor([ids])).logits[0]
        multi = len(labels) == 1 or extra.get("problem_type") == "multi_label_classification"
        if not activation:
            return logits.numpy()
        return (torch.sigmoid(logits) if multi else torch.softmax(logits, -1)).numpy()

    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("c",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/classify", json={"input": texts})
            assert r.status_code == 200, r.text
            for text, data in zip(texts, r.json()["data"], strict=True):
                want = expected(engine.tokenizer.encode(text))
                np.testing.assert_allclose(data["probs"], want, atol=1e-5)
                assert data["label"] == labels[int(want.argmax())]
                assert data["num_classes"] == len(labels)
            # the request's own: raw logits (use_activation off, or `activation`, its older
            # name), the input's last tokens
            ids = engine.tokenizer.encode(texts[2])
            for flag in ({"use_activation": False}, {"activation": False}):
                r = http.post("/classify", json={"input": texts[2], **flag})
                np.testing.assert_allclose(r.json()["data"][0]["probs"],
                                           expected(ids, activation=False), atol=1e-5)
            r = http.post("/classify", json={"input": texts[2], "truncate_prompt_tokens": 3})
            np.testing.assert_allclose(r.json()["data"][0]["probs"], expected(ids[-3:]),
                                       atol=1e-5)
            r = http.post("/v1/score", json={"text_1": "a cat", "text_2": ["a cat", "stocks"]})
            if len(labels) == 1:
                assert r.status_code == 200, r.text
                for second, data in zip(["a cat", "stocks"], r.json()["data"], strict=True):
                    ids = engine.tokenizer.encode_pair("a cat", second)
                    np.testing.assert_allclose(data["score"], expected(ids)[0], atol=1e-5)
                ids = engine.tokenizer.encode_pair("a cat", "stocks")  # a pair cut as one
                r = http.post("/v1/rerank", json={"query": "a cat", "documents": ["stocks"],
                                                  "use_activation": False,
                                                  "truncate_prompt_tokens": 2})
                np.testing.assert_allclose(r.json()["results"][0]["relevance_score"],
                                           expected(ids[-2:], activation=False)[0], atol=1e-5)
            else:
                assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            for path, body in [("/v1/completions", {"prompt": "a", "max_tokens": 2}),
                               ("/v1/embeddings", {"input": "a"})]:
                r = http.post(path, json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    finally:
        server.stop()
        engine.shutdown()


def test_qwen3_reranker_scores_by_its_yes_and_no_rows(tiny_qwen3_dir: Path) -> None:
    """A causal LM read as Qwen3-Reranker is, with vLLM's overrides (`architectures`
    Qwen3ForSequenceClassification, `classifier_from_token` ["no", "yes"],
    `is_original_qwen3_reranker`): a pair's score is sigmoid(logit "yes" - logit "no") of
    the last token, as the model card's softmax over the two gives it; with other tokens
    and no Qwen3 flag, one label a token (a softmax over their logits)."""
    from transformers import AutoModelForCausalLM

    peer = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    engine = engine_for(tiny_qwen3_dir, hf_overrides=json.dumps(overrides))
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("rr",)))).start()
    tok = engine.tokenizer
    no, yes = (tok.backend.token_to_id(t) for t in ("no", "yes"))
    query, documents = "<Query>: what sat on the mat?\n", ["<Document>: a cat", "<Document>: a dog"]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/rerank", json={"query": query, "documents": documents})
            assert r.status_code == 200, r.text
            got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            for i, doc in enumerate(documents):
                with torch.no_grad():
                    logits = peer(torch.tensor([tok.encode_pair(query, doc)])).logits[0, -1]
                want = torch.softmax(logits[[no, yes]], -1)[1]
                assert abs(got[i] - float(want)) < 1e-5
    finally:
        server.stop()
        engine.shutdown()
    tokens = {"architectures": ["Qwen3ForSequenceClassification"],
              "classifier_from_token": ["no", "yes", "maybe"]}
    llm_engine = engine_for(tiny_qwen3_dir, hf_overrides=json.dumps(tokens))
    try:
        out = asyncio.run(llm_engine.embed("is it?", "three"))
        with torch.no_grad():
            logits = peer(torch.tensor([tok.encode("is it?")])).logits[0, -1]
        ids = [tok.backend.token_to_id(t) for t in ("no", "yes", "maybe")]
        np.testing.assert_allclose(out.outputs.embedding,
                                   torch.softmax(logits[ids], -1).numpy(), atol=1e-5)
        assert llm_engine.info.labels == ("no", "yes", "maybe")
    finally:
        llm_engine.shutdown()


def test_bench_serve_drives_embeddings_and_classify(tiny_llama_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice bench serve --endpoint /v1/embeddings` against a real worker: every request
    succeeds, its prompt tokens are the worker's usage (token-id prompts of the asked
    length), TTFT = E2E (the answer comes at once) and no output tokens; `/classify` on
    the same worker is a 400 for each request (no classifier), counted as errors (and
    the run exits 1)."""
    from sluice.cli import main

    engine = engine_for(tiny_llama_dir)
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",)))).start()
    try:
        common = ["bench", "serve", "--base-url", server.url, "--model", "tiny",
                  "--input-len", "24", "--num-prompts", "6", "--max-concurrency", "3",
                  "--warmup", "1", "--disable-tqdm"]
        assert main([*common, "--endpoint", "/v1/embeddings", "--json",
                     str(tmp_path / "e.json")]) == 0
        result = json.loads((tmp_path / "e.json").read_text())["results"][0]
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["total_input_tokens"] == 6 * 24 and result["total_output_tokens"] == 0
        assert result["mean_ttft_ms"] == pytest.approx(result["mean_e2e_ms"])
        assert result["request_throughput"] > 0 and result["mean_tpot_ms"] is None
        assert main([*common, "--endpoint", "/classify", "--json",
                     str(tmp_path / "c.json")]) == 1
        result = json.loads((tmp_path / "c.json").read_text())["results"][0]
        assert result["failed"] == 6 and result["errors"] == {"http_400": 6}
    finally:
        server.stop()
        engine.shutdown()
    capsys.readouterr()


def test_sentence_transformers_dense_modules_project_the_pooled_vector(
        tiny_llama_dir: Path, tmp_path: Path, states: Any) -> None:
    """Dense modules after the Pooling module (LaBSE's shape: a linear and tanh; here a
    second without bias or activation too) map the mean before it is normalized, as
    sentence-transformers computes it; the embedding is the last one's width (and
    `dimensions` is measured against it); one saved as pytorch_model.bin reads too."""
    from safetensors.torch import save_file

    out = sentence_transformers_copy(tiny_llama_dir, tmp_path / "st-dense",
                                     {"pooling_mode_mean_tokens": True}, normalize=True)
    torch.manual_seed(4)
    first = (torch.randn(32, 64) * 0.2, torch.randn(32) * 0.2)
    second = torch.randn(16, 32) * 0.2
    modules = json.loads((out / "modules.json").read_text())
    normalize = modules.pop()  # Dense modules go between Pooling and Normalize
    for i, (name, activation) in enumerate([("2_Dense", "torch.nn.modules.activation.Tanh"),
                                            ("3_Dense", "torch.nn.modules.linear.Identity")]):
        (out / name).mkdir()
        (out / name / "config.json").write_text(json.dumps(
            {"in_features": 64 if i == 0 else 32, "out_features": 32 if i == 0 else 16,
             "bias": i == 0, "activation_function": activation}))
        modules.append({"idx": 2 + i, "name": str(2 + i), "path": name,
                        "type": "sentence_transformers.models.Dense"})
    save_file({"linear.weight": first[0], "linear.bias": first[1]},
              str(out / "2_Dense" / "model.safetensors"))
    torch.save({"linear.weight": second}, out / "3_Dense" / "pytorch_model.bin")
    modules.append({**normalize, "idx": 4, "name": "4", "path": "4_Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))

    engine = engine_for(out, hf_overrides='{"is_matryoshka": true}')
    try:
        got = embed_all(engine, ["hello world", LONG], "dense")
        for text, o in zip(["hello world", LONG], got, strict=True):
            mean = states(text).mean(0)
            want = torch.tanh(mean @ first[0].T + first[1]) @ second.T
            np.testing.assert_allclose(o.outputs.embedding,
                                       torch.nn.functional.normalize(want, dim=-1).numpy(),
                                       atol=2e-5)
        assert engine.info.hidden_size == 16
        server = ServerThread(build_app(engine, WorkerConfig())).start()
        try:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                r = http.post("/v1/embeddings", json={"input": "hello world", "dimensions": 17})
                assert r.status_code == 400 and "exceeds the embedding's 16" in r.text
                r = http.post("/v1/embeddings", json={"input": "hello world", "dimensions": 8})
                assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 8
        finally:
            server.stop()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["MEAN", "CLS", "LAST"])
def test_a_prompt_pooled_in_chunks_starts_over_at_position_zero(kind: str) -> None:
    """The core's bookkeeping across chunks, on plain rows: MEAN sums its chunks' sums,
    CLS keeps the first chunk's row, LAST the last chunk's; a chunk at position 0 (a
    preempted prompt computed again) starts the row over; only the chunk that ends the
    prompt finishes the sequence."""
    from sluice.engine.core import EngineCore
    from sluice.engine.scheduler import ScheduledChunk
    from sluice.engine.sequence import Sequence

    seq = Sequence(1, "r", 0, list(range(40)), 40, SamplingParams(max_tokens=1), 1, 0, 0.0,
                   pooling=kind)
    rows = [torch.full((2,), float(v)) for v in (1, 2, 10, 20, 4)]
    steps = [(0, 16, False), (16, 16, False),  # two chunks, then preempted:
             (0, 16, False), (16, 16, False), (32, 8, True)]  # again from 0, to the end
    finished = []
    for (start, n, last), row in zip(steps, rows, strict=True):
        finished += EngineCore._keep_pooled([ScheduledChunk(seq, start, n, last)], row[None])
    want = {"MEAN": 10 + 20 + 4, "CLS": 10, "LAST": 4}[kind]
    assert seq.pooled.tolist() == [want, want] and finished == [seq]


@pytest.fixture(scope="module")
def bidirectional_gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """EmbeddingGemma's shape: a `Gemma3TextModel` with `use_bidirectional_attention`, a
    window of 8 (each token sees those less than 8 // 2 + 1 = 5 away, either side) in its
    first layer, full attention in its second."""
    from transformers import AutoModel

    return tiny_transformers_model(
        tmp_path_factory.mktemp("tiny-embeddinggemma"), AutoModel, "gemma3_text", seed=5,
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention=True)


def test_bidirectional_gemma_embeds_as_transformers(bidirectional_gemma_dir: Path) -> None:
    """Every token attends to its whole input (and within the window on either side in
    the sliding layer): MEAN-pooled vectors equal transformers' `Gemma3TextModel` for
    inputs shorter and longer than the window, several in one step (the padded path) and
    one alone (the fresh path); generation is refused."""
    from transformers import AutoModel

    peer = AutoModel.from_pretrained(str(bidirectional_gemma_dir), dtype=torch.float32).eval()
    assert peer.config.use_bidirectional_attention and peer.config.sliding_window == 5
    engine = engine_for(bidirectional_gemma_dir, pooler_config='{"pooling_type": "MEAN"}')
    texts = ["hello world", "a cat sat on the mat by the river " * 3, LONG[:300]]
    try:
        for batch in (texts, texts[1:2]):
            outs = embed_all(engine, batch, f"bi-{len(batch)}")
            for text, out in zip(batch, outs, strict=True):
                with torch.no_grad():
                    hidden = peer(torch.tensor([engine.tokenizer.encode(text)])).last_hidden_state
                np.testing.assert_allclose(out.outputs.embedding,
                                           expected(hidden[0], "MEAN", True), atol=2e-5)
        assert engine.info.embedding_only

        async def generate() -> None:
            async for _ in engine.generate("a", SamplingParams(max_tokens=1), "g"):
                pass
        with pytest.raises(InvalidRequestError, match="pooling model"):
            asyncio.run(generate())
    finally:
        engine.shutdown()
