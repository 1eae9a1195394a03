"""One table of equivalences: for OpenAI and Anthropic requests, the gateway's counted
tokens, the router's hashed tokens and the engine's tokens are the same ids, because all
three read the prompt through `sluice.protocol.prompt`; and the ids the gateway passes
downstream are taken by the worker only when they are its own tokenizer's for its text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sluice.engine.tokenizer import load_tokenizer
from sluice.gateway.tokens import PromptTokenCounter
from sluice.protocol import anthropic
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest, parse_request
from sluice.protocol.prompt import (
    CHAT,
    COMPLETION,
    MESSAGES,
    IdsHint,
    TokenCache,
    fingerprint,
    prompt_view,
)
from sluice.router.parse import parse_request as router_parse
from sluice.router.tokens import PromptTokenizer
from sluice.worker import chat as worker_chat
from sluice.worker import completions as worker_completions

M = "tiny"
U = {"role": "user", "content": "What is the capital of France?"}
TABLE: list[tuple[str, str, dict[str, Any]]] = [
    ("chat, one user message", CHAT, {"messages": [U]}),
    ("chat, system prompt", CHAT, {"messages": [{"role": "system", "content": "Be brief."}, U]}),
    ("chat, developer is system", CHAT, {"messages": [{"role": "developer", "content": "Be brief."}, U]}),
    ("chat, empty system kept", CHAT, {"messages": [{"role": "system", "content": ""}, U]}),
    ("chat, content parts", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "text", "text": "the capital?"}]}]}),
    ("chat, multi-turn", CHAT, {"messages": [U, {"role": "assistant", "content": "Paris."},
                                             {"role": "user", "content": "And of Spain?"}]}),
    ("anthropic, plain", MESSAGES, {"max_tokens": 8, "messages": [U]}),
    ("anthropic, system string", MESSAGES, {"max_tokens": 8, "system": "Be brief.",
                                            "messages": [U]}),
    ("anthropic, empty system dropped", MESSAGES, {"max_tokens": 8, "system": "",
                                                   "messages": [U]}),
    ("anthropic, system blocks", MESSAGES, {"max_tokens": 8, "system": [
        {"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}], "messages": [U]}),
    ("anthropic, content blocks", MESSAGES, {"max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Capital of France?"}]}]}),
    ("completion, text", COMPLETION, {"prompt": "The capital of France is"}),
]


class _Captured(Exception):
    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts


class _FakeState:
    """What prepare_chat/prepare_completion read from the worker's state."""

    def __init__(self, tokenizer: Any) -> None:
        self.engine = type("E", (), {"tokenizer": tokenizer, "max_model_len": 4096})()

    def check_model(self, model: str | None) -> str:
        return model or M

    def require_engine(self) -> Any:
        return self.engine


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    return load_tokenizer(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def counter(tiny_llama_dir: Path) -> PromptTokenCounter:
    return PromptTokenCounter(default_source=str(tiny_llama_dir))


async def engine_ids(tok: Any, kind: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                     hint: IdsHint | None = None) -> list[int]:
    """The ids the worker's own prepare step hands the engine (Run.start intercepted)."""
    async def capture(cls: Any, state: Any, prompts: list[list[int]], *a: Any, **kw: Any) -> Any:
        raise _Captured([list(p) for p in prompts])

    monkeypatch.setattr(worker_chat.Run, "start", classmethod(capture))
    state: Any = _FakeState(tok)
    try:
        if kind == COMPLETION:
            req = parse_request(CompletionRequest, {"model": M, **body})
            await worker_completions.prepare_completion(state, req, "r", hint)
        else:
            if kind == MESSAGES:
                body = anthropic.to_chat_body(parse_request(anthropic.MessagesRequest,
                                                            {"model": M, **body}))
            req = parse_request(ChatCompletionRequest, {"model": M, **body})
            await worker_chat.prepare_chat(state, req, "r", hint)
    except _Captured as got:
        return got.prompts[0]
    raise AssertionError("the engine was never reached")


@pytest.mark.parametrize(("name", "kind", "body"), TABLE, ids=[t[0] for t in TABLE])
async def test_gateway_router_and_engine_see_the_same_tokens(
        tok: Any, counter: PromptTokenCounter, monkeypatch: pytest.MonkeyPatch,
        name: str, kind: str, body: dict[str, Any]) -> None:
    view = prompt_view(kind, body)
    counted = counter.prompt_tokens(M, view)
    assert counted is not None
    count, hint = counted
    router = PromptTokenizer(client=None, cache=TokenCache())  # type: ignore[arg-type]
    req = router_parse(kind, json.dumps({"model": M, **body}).encode(), {})
    hashed = await router.tokens(req, M, tok, None)
    assert hashed is not None
    engine = await engine_ids(tok, kind, body, monkeypatch)
    assert count == len(hashed.tokens.ids) == len(engine), name
    assert hashed.tokens.ids == engine, name
    assert counter(M, {"model": M, **body}) == count  # the plain counter agrees
    if kind != COMPLETION:
        assert hint is not None and hint.ids == engine
        # the worker takes the gateway's ids as they are, without tokenizing (marked ids
        # under the same fingerprint and digest show which ids it used) ...
        marked = IdsHint(hint.fingerprint, hint.digest, list(reversed(engine)))
        assert await engine_ids(tok, kind, body, monkeypatch, marked) == marked.ids
        # ... and the router passes on the gateway's hint without tokenizing again
        again = await router.tokens(req, M, tok, None, hint)
        assert again is not None and again.hint is hint


async def test_the_worker_ignores_ids_not_made_for_its_text_or_tokenizer(
        tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"messages": [U]}
    real = await engine_ids(tok, CHAT, body, monkeypatch)
    other_text = IdsHint(fingerprint(tok), "0" * 24, [1, 2, 3])
    other_tok = IdsHint("ffffffffffff", other_text.digest, [1, 2, 3])
    for hint in (other_text, other_tok, IdsHint.decode(b"garbage")):
        assert await engine_ids(tok, CHAT, body, monkeypatch, hint) == real
    assert IdsHint.decode(IdsHint("ab", "cd", [0, 7, 2**31]).encode()) == IdsHint(
        "ab", "cd", [0, 7, 2**31])


@pytest.mark.parametrize("kind", [CHAT, MESSAGES])
def test_images_are_refused_naming_the_content(kind: str) -> None:
    image = {"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    with pytest.raises(InvalidRequestError) as err:
        prompt_view(kind, {"messages": [image]})
    assert err.value.param == "messages.0.content"
