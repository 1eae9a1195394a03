"""POST /v1/embeddings on a worker: the tiny random Llama in float32, checked against
transformers' own last hidden state (after the final norm) at the last token, normalized."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.messages import Add, CoreOutputs, CoreRequest, SeqUpdate, decode, encode
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.stats import EngineStats
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .conftest import TINY_OPTIONS
from .worker_helpers import ServerThread

LONG = "the river runs to the sea " * 90  # ~540 tokens: two chunks of the 512 budget
ENGINE_DTYPE = "float32"  # the conftest's engine, as transformers computes the reference


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path, engine: Any) -> Any:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()

    def embed(text_or_ids: str | list[int]) -> np.ndarray:
        ids = engine.tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) \
            else text_or_ids
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=-1).numpy()

    return embed


def vectors(body: dict[str, Any]) -> list[np.ndarray]:
    assert [d["index"] for d in body["data"]] == list(range(len(body["data"])))
    assert all(d["object"] == "embedding" for d in body["data"])
    return [np.asarray(d["embedding"], dtype=np.float32) for d in body["data"]]


def test_texts_and_ids_match_transformers(http: httpx.Client, reference: Any,
                                          engine: Any) -> None:
    ids = engine.tokenizer.encode("token ids in")
    inputs: list[Any] = ["hello world", LONG, "x"]
    r = http.post("/v1/embeddings", json={"model": "tiny", "input": inputs})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    got = vectors(body)
    for text, vec in zip(inputs, got, strict=True):
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-5
        np.testing.assert_allclose(vec, reference(text), atol=1e-5)
    counted = sum(len(engine.tokenizer.encode(t)) for t in inputs)
    assert body["usage"] == {"prompt_tokens": counted, "total_tokens": counted}
    one = http.post("/v1/embeddings", json={"model": "tiny", "input": ids}).json()
    np.testing.assert_allclose(vectors(one)[0], reference(ids), atol=1e-5)
    assert one["usage"]["prompt_tokens"] == len(ids)


def test_base64_is_the_float32_bytes_and_the_sdk_reads_it(http: httpx.Client,
                                                          server: ServerThread) -> None:
    floats = http.post("/v1/embeddings", json={"input": ["a cat", "a dog"]}).json()
    raw = http.post("/v1/embeddings", json={"input": ["a cat", "a dog"],
                                            "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], raw["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(f["embedding"], dtype=np.float32))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    resp = client.embeddings.create(model="tiny", input=["a cat", "a dog"])  # base64 asked
    assert [len(d.embedding) for d in resp.data] == [len(floats["data"][0]["embedding"])] * 2
    np.testing.assert_allclose(resp.data[1].embedding, floats["data"][1]["embedding"],
                               atol=1e-7)
    assert resp.usage.prompt_tokens == floats["usage"]["prompt_tokens"]


def test_a_cached_prefix_gives_the_same_vector(engine: Any) -> None:
    text = "a prompt no other test sends, long enough for full blocks " * 8

    async def twice() -> tuple[Any, Any]:
        first = await engine.embed(text, "cache-1")
        return first, await engine.embed(text, "cache-2")

    first, second = asyncio.run(twice())
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    # (the cached run computes the last token alone: another GEMM shape, float rounding)
    np.testing.assert_allclose(first.outputs.embedding, second.outputs.embedding, atol=1e-6)


def test_embeddings_batch_with_generation(engine: Any, reference: Any) -> None:
    """Pooled prompts and decoding streams in the same steps: both come out right (a
    one-token input is shaped like a decode, and must not go to the decode graph)."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def mixed() -> tuple[list[Any], list[int]]:
        async def generate() -> list[int]:
            ids: list[int] = []
            async for out in engine.generate("Once upon a time", params, "gen-mix"):
                ids += out.outputs[0].token_ids
            return ids

        gen = asyncio.ensure_future(generate())
        await asyncio.sleep(0.05)
        embeds = await asyncio.gather(*(engine.embed(x, f"mix-{i}") for i, x in
                                        enumerate([[5], "two words", [7], LONG])))
        return embeds, await gen

    async def alone() -> list[int]:
        ids: list[int] = []
        async for out in engine.generate("Once upon a time", params, "gen-alone"):
            ids += out.outputs[0].token_ids
        return ids

    embeds, generated = asyncio.run(mixed())
    assert generated == asyncio.run(alone())
    for x, out in zip([[5], "two words", [7], LONG], embeds, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, reference(x), atol=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate": True}, "truncate"),
    ({"input": 3}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": [[1, 2], "mixed"]}, "input"),
])
def test_bad_input_is_a_400_naming_it(http: httpx.Client, body: dict[str, Any],
                                      param: str) -> None:
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].split(".")[0] == param, error
    assert error["type"] == "invalid_request_error"


def test_too_long_unknown_model(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"input": [1] * (TINY_OPTIONS["max_model_len"] + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "maximum context length" in r.json()["error"]["message"]
    r = http.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert http.post("/v1/embeddings", json={"input": "still serving"}).status_code == 200


def test_pooling_crosses_the_process_boundary() -> None:
    """The core in its own process: the pooling flag and the vector survive msgpack."""
    add = decode(encode(Add(CoreRequest("r", [1, 2], SamplingParams(max_tokens=1),
                                        max_tokens=1, pooling=True))))
    assert isinstance(add, Add) and add.request.pooling
    vec = np.arange(4, dtype="<f4").tobytes()
    out = decode(encode(CoreOutputs([SeqUpdate("r", 0, [], finish_reason="stop",
                                               embedding=vec)],
                                    EngineStats(0, 0, 0.0, 8, 0, 0, 0, 0, 0, 0))))
    assert isinstance(out, CoreOutputs) and out.updates[0].embedding == vec


def test_offline_llm_embed_matches(tiny_llama_dir: Path, reference: Any) -> None:
    """vLLM's `LLM.embed`, in one thread: the same vectors, in order, beside generation."""
    from sluice.engine.llm import LLM
    from sluice.protocol.errors import InvalidRequestError

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256)
    inputs: list[Any] = ["hello world", [5, 6, 7], LONG]
    outs = llm.embed(inputs)
    for x, out in zip(inputs, outs, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, reference(x), atol=1e-5)
    assert outs[1].prompt_token_ids == [5, 6, 7]
    with pytest.raises(InvalidRequestError) as bad:
        llm.embed([[10**8]])
    assert bad.value.param == "prompt"
    assert llm.generate(["still generates"])[0].outputs[0].token_ids
    assert not llm.engine.embeddings and not llm.engine.has_unfinished_requests()


def test_score_is_the_cosine_of_the_embeddings(http: httpx.Client) -> None:
    texts = ["a cat sat", "a dog ran", "stock prices fell"]
    vecs = vectors(http.post("/v1/embeddings", json={"input": texts}).json())
    one = http.post("/v1/score", json={"model": "tiny", "text_1": texts[0],
                                       "text_2": texts}).json()
    assert one["object"] == "list" and one["model"] == "tiny"
    assert [d["index"] for d in one["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in one["data"]],
                               [float(vecs[0] @ v) for v in vecs], atol=1e-5)
    assert abs(one["data"][0]["score"] - 1.0) < 1e-5
    pairwise = http.post("/v1/score", json={"text_1": texts[:2], "text_2": texts[1:]}).json()
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]],
                               [float(vecs[0] @ vecs[1]), float(vecs[1] @ vecs[2])], atol=1e-5)
    assert one["usage"]["prompt_tokens"] == sum(  # every text embedded is counted
        len(http.post("/tokenize", json={"prompt": t}).json()["tokens"])
        for t in [texts[0], *texts])


def test_rerank_orders_documents_by_score(http: httpx.Client) -> None:
    docs = ["stock prices fell", "a dog ran", "a cat sat on the mat", "a cat sat"]
    scores = [d["score"] for d in http.post("/v1/score", json={
        "text_1": "a cat sat", "text_2": docs}).json()["data"]]
    r = http.post("/v1/rerank", json={"model": "tiny", "query": "a cat sat",
                                      "documents": docs, "top_n": 2}).json()
    best = sorted(range(len(docs)), key=lambda i: -scores[i])[:2]
    assert [x["index"] for x in r["results"]] == best == [3, best[1]]
    assert [x["document"]["text"] for x in r["results"]] == [docs[i] for i in best]
    np.testing.assert_allclose([x["relevance_score"] for x in r["results"]],
                               [scores[i] for i in best], atol=1e-5)
    assert r["usage"]["total_tokens"] > 0 and r["id"].startswith("rerank-")
    bare = http.post("/v1/rerank", json={"query": "q", "documents": ["a", "b"],
                                         "return_documents": False}).json()
    assert len(bare["results"]) == 2 and all("document" not in x for x in bare["results"])


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "x"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ""}, "text_2"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
])
def test_bad_scoring_requests_are_400s(http: httpx.Client, path: str, body: dict[str, Any],
                                       param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_metrics_count_embedding_requests(http: httpx.Client) -> None:
    def success() -> float:
        text = http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{")
                   and 'finished_reason="stop"' in line)

    before = success()
    assert http.post("/v1/embeddings", json={"input": ["one", "two", "three"]}).status_code == 200
    assert success() == before + 3


@pytest.mark.parametrize("overrides, good, bad", [
    ({"matryoshka_dimensions": [8, 16, 32]}, 16, [12, 0, 64]),  # the sizes listed only
    ({"is_matryoshka": True}, 12, [0, 65]),  # any size up to the embedding's 64
])
def test_matryoshka_dimensions_cut_and_renormalize(tiny_llama_dir: Path, reference: Any,
                                                   overrides: dict[str, Any], good: int,
                                                   bad: list[int]) -> None:
    """A model marked Matryoshka through `hf_overrides` (config.json's
    `matryoshka_dimensions` or `is_matryoshka`, as vLLM reads them) answers `dimensions`
    with each embedding's first values normalized again, as JSON floats and base64; a
    size it is not trained for (not listed, below 1, past the embedding) is a 400 naming
    `dimensions`. (A model not so marked refuses `dimensions` at all: above.)"""
    from sluice.engine.async_engine import AsyncEngine

    eng = AsyncEngine(EngineConfig.from_options(str(tiny_llama_dir), dtype=ENGINE_DTYPE,
                                                hf_overrides=overrides, **TINY_OPTIONS))
    srv = ServerThread(build_app(eng, WorkerConfig(served_model_names=("tiny",)))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            r = http.post("/v1/embeddings", json={"input": ["hello world", "x"],
                                                  "dimensions": good})
            assert r.status_code == 200, r.text
            for text, vec in zip(["hello world", "x"], vectors(r.json()), strict=True):
                head = reference(text)[:good]
                np.testing.assert_allclose(vec, head / np.linalg.norm(head), atol=1e-5)
            r = http.post("/v1/embeddings", json={"input": "x", "dimensions": good,
                                                  "encoding_format": "base64"})
            raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")
            assert raw.shape == (good,) and abs(np.linalg.norm(raw) - 1.0) < 1e-5
            for size in bad:
                r = http.post("/v1/embeddings", json={"input": "x", "dimensions": size})
                assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    finally:
        srv.stop()
        eng.shutdown()
