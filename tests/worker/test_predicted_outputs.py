"""OpenAI's predicted outputs through the worker's chat API (the OpenAI SDK's
`prediction=`): the same answer as without it, streamed or not, and OpenAI's
`accepted_prediction_tokens` / `rejected_prediction_tokens` in the usage; a malformed
prediction is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from .test_errors import openai_error
from .worker_helpers import ServerThread

ENGINE_DTYPE = "float32"  # the same outputs on every CPU (conftest's engine)
USER = [{"role": "user", "content": "Rewrite this list in the same order: apples, pears"}]


@pytest.fixture()
def client(engine: Any, server: ServerThread) -> openai.OpenAI:
    # every draft a prediction yields is verified: the counts asserted are the
    # proposer's, not the cost model's (which weighs measured step times: on a busy host
    # it drafted fewer, 6 accepted where 10 were asserted, none rejected)
    engine.client.core.spec.planner.adaptive = False
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=USER, max_tokens=32,
                                          temperature=0, **kw)


def test_the_answer_is_the_same_and_the_usage_counts_the_prediction(
        client: openai.OpenAI) -> None:
    plain = ask(client)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # asked no prediction
    right = ask(client, prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    # (the text tokenized again can split a word otherwise than the random model's
    # output did: a few drafted tokens refused there, the output found again after)
    assert details.accepted_prediction_tokens >= 20
    assert details.rejected_prediction_tokens < details.accepted_prediction_tokens
    assert right.usage.completion_tokens == plain.usage.completion_tokens == 32
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": "zzz zzz zzz"},
             {"type": "text", "text": text[10:]}]  # text parts, with an insertion
    edited = ask(client, prediction={"type": "content", "content": parts})
    assert edited.choices[0].message.content == text
    d = edited.usage.completion_tokens_details
    assert d.accepted_prediction_tokens >= 10
    assert d.rejected_prediction_tokens >= 1  # at least the insertion's first token


def test_streamed_with_usage(client: openai.OpenAI) -> None:
    text = ask(client).choices[0].message.content
    chunks = list(ask(client, prediction={"type": "content", "content": text}, stream=True,
                      stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens >= 20


@pytest.mark.parametrize(("prediction", "param"), [
    ({"type": "content"}, "prediction.content"),
    ({"type": "diff", "content": "x"}, "prediction.type"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
     "prediction.content"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
    ("apples", "prediction"),
])
def test_a_malformed_prediction_names_the_field(http: httpx.Client, prediction: Any,
                                                param: str) -> None:
    openai_error(http.post("/v1/chat/completions",
                           json={"messages": USER, "prediction": prediction}), 400, param)
