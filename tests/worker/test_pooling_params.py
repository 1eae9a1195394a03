"""vLLM's per-request pooling parameters and prompt truncation: `truncate_prompt_tokens`
(embeddings, classify, score, completions, chat, `SamplingParams`, `PoolingParams`),
`use_activation` (and its older names), the chat form of `/v1/embeddings` (`messages`),
`add_special_tokens` on an embedding's input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.messages import Add, CoreRequest, decode, encode
from sluice.engine.pooling_params import PoolingParams
from sluice.engine.sampling_params import SamplingParams
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.prompt import EMBEDDINGS, prompt_view
from sluice.worker.app import build_app
from sluice.worker.config import WorkerConfig

from .test_pooling import engine_for, expected
from .worker_helpers import ServerThread

TEXT = "the quick brown fox jumps over the lazy dog and runs far away"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def states(tiny_llama_dir: Path) -> Any:
    """Token ids -> transformers' final hidden states (after the last norm), float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).last_hidden_state[0]

    return run


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Any:
    engine = engine_for(tiny_llama_dir)  # LAST pooling, normalized (a decoder's default)
    server = ServerThread(build_app(engine, WorkerConfig(served_model_names=("tiny",)))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            yield engine, http
    finally:
        server.stop()
        engine.shutdown()


def test_embeddings_truncate_to_the_last_tokens(served: Any, states: Any) -> None:
    """`truncate_prompt_tokens: k` embeds the input's last k tokens (special ones
    counted), text or ids, and usage counts those; -1 is the context length."""
    engine, http = served
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 6
    want = expected(states(ids[-5:]), "LAST", True)
    for given in ([TEXT, TEXT], [ids, ids]):
        r = http.post("/v1/embeddings", json={"input": given, "truncate_prompt_tokens": 5})
        assert r.status_code == 200, r.text
        for data in r.json()["data"]:
            np.testing.assert_allclose(data["embedding"], want, atol=2e-5)
        assert r.json()["usage"]["prompt_tokens"] == 10
    r = http.post("/v1/embeddings", json={"input": TEXT, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize("value", [0, -2, 1025, "5", 2.5, True])
def test_a_bad_truncation_is_a_400_naming_it(served: Any, value: Any) -> None:
    """0, below -1, past the context length (1024 here, vLLM's message), or not an
    integer: a 400 naming `truncate_prompt_tokens`, on every route that takes it."""
    _, http = served
    for path, body in [("/v1/embeddings", {"input": "a b"}),
                       ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/completions", {"prompt": "a b", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})]:
        r = http.post(path, json={**body, "truncate_prompt_tokens": value})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "truncate_prompt_tokens", (path, r.text)
    r = http.post("/v1/embeddings", json={"input": "a", "truncate_prompt_tokens": 1025})
    assert "greater than max_model_len (1024)" in r.json()["error"]["message"]


def test_use_activation_off_gives_the_raw_pooled_vector(served: Any, states: Any) -> None:
    """`use_activation: false` (or its older name `normalize: false`) skips the L2
    normalization; `dimensions` then cuts without normalizing again; the two names
    disagreeing is a 400 naming the older."""
    engine, http = served
    ids = engine.tokenizer.encode(TEXT)
    raw = expected(states(ids), "LAST", False)
    for flag in ({"use_activation": False}, {"normalize": False}):
        r = http.post("/v1/embeddings", json={"input": TEXT, **flag})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], raw, atol=2e-5)
    r = http.post("/v1/embeddings", json={"input": TEXT, "use_activation": True})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                               expected(states(ids), "LAST", True), atol=2e-5)
    r = http.post("/v1/embeddings", json={"input": TEXT, "use_activation": False,
                                          "normalize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "normalize"


def test_embeddings_of_a_conversation(served: Any, states: Any) -> None:
    """vLLM's chat form: `messages` through the chat template, with no assistant opening
    and no added special tokens unless asked; it is one input (`index` 0); usage counts
    its tokens. Both forms at once, neither, or a chat field with `input`: a 400."""
    engine, http = served
    tok = engine.tokenizer
    for extra, opening in [({}, False), ({"add_generation_prompt": True}, True)]:
        r = http.post("/v1/embeddings", json={"messages": CHAT, **extra})
        assert r.status_code == 200, r.text
        ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=opening),
                         add_special_tokens=False)
        (data,) = r.json()["data"]
        np.testing.assert_allclose(data["embedding"], expected(states(ids), "LAST", True),
                                   atol=2e-5)
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    r = http.post("/v1/embeddings", json={"messages": CHAT, "truncate_prompt_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
    for body, param in [({"messages": CHAT, "input": "a"}, "input"), ({}, "input"),
                        ({"messages": []}, "messages"),
                        ({"input": "a", "add_generation_prompt": True}, "add_generation_prompt"),
                        ({"messages": CHAT, "add_generation_prompt": True,
                          "continue_final_message": True}, "continue_final_message")]:
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_add_special_tokens_on_an_input(served: Any, states: Any) -> None:
    """An input's text is tokenized with the tokenizer's special tokens unless
    `add_special_tokens: false` (the ids are then the bare text's)."""
    engine, http = served
    r = http.post("/v1/embeddings", json={"input": TEXT, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    np.testing.assert_allclose(r.json()["data"][0]["embedding"],
                               expected(states(ids), "LAST", True), atol=2e-5)


def test_generation_truncates_the_prompt(served: Any) -> None:
    """Completions and chat cut the prompt to its last k tokens before the context check:
    the answer is the truncated prompt's (greedy), usage counts k, an echo shows the
    text the model read."""
    engine, http = served
    ids = engine.tokenizer.encode(TEXT)
    greedy = {"max_tokens": 4, "temperature": 0.0}
    r = http.post("/v1/completions", json={"prompt": TEXT, "truncate_prompt_tokens": 6,
                                           "echo": True, **greedy})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 6
    tail = engine.tokenizer.decode(ids[-6:], skip_special_tokens=False)
    direct = http.post("/v1/completions", json={"prompt": ids[-6:], **greedy}).json()
    assert body["choices"][0]["text"] == tail + direct["choices"][0]["text"]
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "truncate_prompt_tokens": 3,
                                                **greedy})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text
    # a prompt of 1,100 tokens fits once cut (the context is 1,024)
    r = http.post("/v1/completions", json={"prompt": [5] * 1100, "truncate_prompt_tokens": 1000,
                                           **greedy})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 1000, r.text


def test_offline_truncation_and_pooling_params(tiny_llama_dir: Path, states: Any) -> None:
    """`SamplingParams(truncate_prompt_tokens=k)`, `LLM.embed(truncate_prompt_tokens=k)`
    and `PoolingParams(use_activation=False)`, one for all prompts or one each."""
    with LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=16, max_model_len=256,
             dtype="float32") as llm:
        ids = llm.get_tokenizer().encode(TEXT)
        (out,) = llm.generate([TEXT], SamplingParams(max_tokens=2, truncate_prompt_tokens=4))
        assert out.prompt_token_ids == ids[-4:]
        (emb,) = llm.embed([TEXT], truncate_prompt_tokens=3)
        np.testing.assert_allclose(emb.outputs.embedding,
                                   expected(states(ids[-3:]), "LAST", True), atol=2e-5)
        raw, unit = llm.embed([TEXT, TEXT], pooling_params=[
            PoolingParams(use_activation=False), PoolingParams()])
        np.testing.assert_allclose(raw.outputs.embedding, expected(states(ids), "LAST", False),
                                   atol=2e-5)
        np.testing.assert_allclose(unit.outputs.embedding, expected(states(ids), "LAST", True),
                                   atol=2e-5)
        with pytest.raises(InvalidRequestError) as err:
            llm.embed([TEXT], truncate_prompt_tokens=300)
        assert err.value.param == "truncate_prompt_tokens"
    for bad in (0, -5, 1.5, "3"):
        with pytest.raises(InvalidRequestError) as err:
            SamplingParams(truncate_prompt_tokens=bad)
        assert err.value.param == "truncate_prompt_tokens"
        with pytest.raises(InvalidRequestError):
            PoolingParams(truncate_prompt_tokens=bad)
    with pytest.raises(InvalidRequestError) as err:
        PoolingParams(use_activation=1)  # type: ignore[arg-type]
    assert err.value.param == "use_activation"


def test_a_pooling_request_crosses_the_process_boundary_whole() -> None:
    """The engine core's wire keeps a pooling request's activation choice."""
    request = CoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=1), pooling=True,
                          use_activation=False)
    (back,) = [decode(encode(Add(request)))]
    assert isinstance(back, Add) and back.request == request


def test_the_router_and_gateway_read_a_chat_embedding_as_the_worker_does() -> None:
    """The prompt view of `/v1/embeddings` with `messages` is a chat view without the
    assistant's opening (as the worker templates it), unless asked."""
    view = prompt_view(EMBEDDINGS, {"messages": CHAT})
    assert view.messages is not None and len(view.messages) == 2
    assert not view.generation_prompt
    assert prompt_view(EMBEDDINGS, {"messages": CHAT,
                                    "add_generation_prompt": True}).generation_prompt
    assert prompt_view(EMBEDDINGS, {"input": "a b"}).texts == ("a b",)


LONG = "the river runs to the sea " * 90  # ~540 tokens: two chunks of the 512 budget


def test_pooling_route_answers_each_task(served: Any, states: Any) -> None:
    """vLLM's `/pooling`: no task is the model's (embed here: /v1/embeddings' vector);
    `token_embed` is one row a prompt token (each normalized unless `use_activation` is
    false), a long prompt's rows gathered over its chunks; base64 is the rows' float32
    bytes in order; a task the model lacks is a 400 naming `task`."""
    engine, http = served
    ids = engine.tokenizer.encode(TEXT)
    r = http.post("/pooling", json={"input": TEXT})
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    assert item["object"] == "pooling"
    np.testing.assert_allclose(item["data"], expected(states(ids), "LAST", True), atol=2e-5)
    hidden = states(ids)
    unit = torch.nn.functional.normalize(hidden, dim=-1).numpy()
    for extra, want in [({}, unit), ({"use_activation": False}, hidden.numpy())]:
        r = http.post("/pooling", json={"input": TEXT, "task": "token_embed", **extra})
        assert r.status_code == 200, r.text
        rows = np.asarray(r.json()["data"][0]["data"])
        assert rows.shape == (len(ids), hidden.shape[1])
        np.testing.assert_allclose(rows, want, atol=2e-5)
    long_ids = engine.tokenizer.encode(LONG)
    r = http.post("/pooling", json={"input": [LONG, "x"], "task": "token_embed",
                                    "encoding_format": "base64", "use_activation": False})
    assert r.status_code == 200, r.text
    import base64
    rows = np.frombuffer(base64.b64decode(r.json()["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(rows.reshape(len(long_ids), -1), states(long_ids).numpy(),
                               atol=2e-5)
    assert r.json()["usage"]["prompt_tokens"] == len(long_ids) + len(engine.tokenizer.encode("x"))
    for task in ("classify", "token_classify", "summarize"):
        r = http.post("/pooling", json={"input": TEXT, "task": task})
        assert r.status_code == 400 and r.json()["error"]["param"] == "task", r.text


def test_llm_encode_token_classify(tmp_path: Path) -> None:
    """`LLM.encode(pooling_task="token_classify")` on a decoder classifier: its `score`
    head on every token's state, through the softmax (or raw with use_activation off),
    as transformers' per-token logits; `classify` is the last token's row."""
    from transformers import AutoModelForSequenceClassification

    from .test_pooling import decoder_classifier

    labels = {0: "bad", 1: "ok", 2: "good"}
    model_dir = decoder_classifier(tmp_path / "tiny-qwen2-classifier", "qwen2", labels)
    peer = AutoModelForSequenceClassification.from_pretrained(
        str(model_dir), dtype=torch.float32).eval()
    with LLM(str(model_dir), num_kv_blocks=64, block_size=16, max_model_len=256,
             dtype="float32") as llm:
        ids = llm.get_tokenizer().encode(TEXT)
        with torch.no_grad():
            logits = peer.score(peer.model(torch.tensor([ids])).last_hidden_state)[0]
        (tokens,) = llm.encode([TEXT], pooling_task="token_classify")
        assert tokens.outputs.data.shape == (len(ids), len(labels))
        torch.testing.assert_close(tokens.outputs.data, torch.softmax(logits, -1), atol=1e-5,
                                   rtol=1e-4)
        (raw,) = llm.encode([TEXT], pooling_task="token_classify",
                            pooling_params=PoolingParams(use_activation=False))
        torch.testing.assert_close(raw.outputs.data, logits, atol=1e-5, rtol=1e-4)
        (last,) = llm.encode([TEXT], pooling_task="classify")
        torch.testing.assert_close(last.outputs.data, torch.softmax(logits[-1], -1), atol=1e-5,
                                   rtol=1e-4)
        with pytest.raises(InvalidRequestError) as err:
            llm.encode([TEXT], pooling_task="token_embed")
        assert err.value.param == "task"
