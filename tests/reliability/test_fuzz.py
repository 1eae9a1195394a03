"""Schema fuzzing (schemathesis + hypothesis) of the worker, the router and the gateway,
as running processes over real HTTP.

The OpenAPI documents: the worker and the router serve theirs at /openapi.json (FastAPI),
but their handlers read bodies by hand, so those documents describe no request bodies;
the router's routed endpoints (/v1/chat/completions, ...) are not in its document at
all (they are served ahead of FastAPI). Each document is therefore completed here with
the worker's wire types (`protocol.openai`, `protocol.anthropic`) as the bodies of the
generation and tokenizer endpoints, and that one schema is fuzzed against the worker,
through the router, and through `sluice serve` (gateway + router, with the dev key).
The gateway's own admin API has no served document (`openapi_url=None`); its FastAPI
app produces one, fuzzed with the admin key.

Each target gets positive (schema-valid) and negative (schema-violating) cases; every
answer must be below 500, and every error must be in OpenAI's shape (Anthropic's on
/v1/messages); the process must answer /health afterwards. A valid request could ask
for 128 choices of 500 tokens, so generation is bounded before sending: `max_tokens` /
`max_completion_tokens` above 8 (or absent) become 8, `n` above 2 becomes 2.

Examples per target: FUZZ_EXAMPLES (200, a few seconds each; `SLUICE_FUZZ_EXAMPLES=1000` for a long run,
which also draws new random cases each run instead of the fixed CI sequence).
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from schemathesis import GenerationMode

from .checks import error_shape
from .conftest import ADMIN_KEY, Process, Stack

FUZZ_EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "200"))
# 5xx answers per run that the same request, sent again, did not get (see `fuzz`): seen
# here twice in ten runs as one 503 on the router, cause not yet known (docs/reliability.md)
TRANSIENT_5XX = 1
MAX_TOKENS = 8
MAX_N = 2


def body_models() -> dict[str, type[BaseModel]]:
    from sluice.protocol import anthropic, openai

    return {"/v1/chat/completions": openai.ChatCompletionRequest,
            "/v1/completions": openai.CompletionRequest,
            "/v1/messages": anthropic.MessagesRequest,
            "/v1/messages/count_tokens": anthropic.CountTokensRequest,
            "/tokenize": openai.TokenizeRequest,
            "/detokenize": openai.DetokenizeRequest}


def with_bodies(doc: dict[str, Any], models: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """`doc` with a JSON request body on `POST path` for each path in `models` (added
    when the document lacks the path, as the router's does for its routed endpoints)."""
    doc = copy.deepcopy(doc)
    refs, defs = models_json_schema([(m, "validation") for m in models.values()],
                                    ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for path, model in models.items():
        operation = doc["paths"].setdefault(path, {}).setdefault(
            "post", {"responses": {"200": {"description": "OK"}}})
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(model, "validation")]}}}
    return doc


def live_doc(process: Process) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(process.url + "/openapi.json", timeout=10).json()
    return doc


def gateway_admin_doc(tmp_path: Path) -> dict[str, Any]:
    from sluice.gateway.admin import build_admin_app
    from sluice.gateway.config import GatewayConfig
    from sluice.gateway.state import GatewayState
    from sluice.gateway.store import SQLStore

    store = SQLStore(f"sqlite:///{tmp_path / 'doc.db'}")
    try:
        return build_admin_app(GatewayState.from_config(GatewayConfig(), store=store)).openapi()
    finally:
        store.close()


def bounded(body: Any, model: str) -> Any:
    """The body with generation capped (see the module docstring) and `model` filled in
    when absent (the router and the gateway need it; the worker does not); others
    unchanged."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    body.setdefault("model", model)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        body["n"] = MAX_N
    return body


def fuzz(doc: dict[str, Any], base_url: str, headers: dict[str, str], stack: Stack,
         skip: frozenset[str] = frozenset()) -> list[tuple[str, str, int]]:
    """Run FUZZ_EXAMPLES cases against `base_url`; returns (method, path template,
    status) per case.
    Fails on the first 5xx the same request gets again, a connection failure, or an
    error in the wrong shape. A 5xx that the same request, sent again at once, does not
    get is not caused by the input: it is reported (a warning with the response and
    the processes' logs) and at most TRANSIENT_5XX of them are allowed per run."""
    doc = {**doc, "paths": {p: ops for p, ops in doc["paths"].items()
                            if p not in skip and not p.startswith(("/docs", "/redoc"))}}
    schema = schemathesis.openapi.from_dict(doc)
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                         schema.as_strategy(GenerationMode.NEGATIVE))
    seen: list[tuple[str, str, int]] = []
    transient: list[str] = []
    session = requests.Session()

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              derandomize="SLUICE_FUZZ_EXAMPLES" not in os.environ, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def one(case: Any) -> None:
        if case.body is not None and not isinstance(case.body, bytes | str):
            case.body = bounded(case.body, stack.model)
        path = case.formatted_path
        response = case.call(base_url=base_url, session=session, headers=headers, timeout=60)
        if response.status_code >= 500:
            failure = (f"{case.method} {path} {case.body!r} -> {response.status_code} "
                       f"{response.text[:1000]}\n" + "\n".join(p.text()[-3000:]
                                                              for p in stack.all()))
            response = case.call(base_url=base_url, session=session, headers=headers,
                                 timeout=60)
            if response.status_code >= 500:  # pytest.fail: the whole text, not truncated
                pytest.fail(f"twice: {failure}")
            warnings.warn(f"a 5xx the same request did not get again: {failure}",
                          stacklevel=1)
            transient.append(failure)
        seen.append((case.method, case.path, response.status_code))  # the template path
        if response.status_code >= 400:
            error_shape(path, response.status_code, response.content)

    one()
    session.close()
    assert len(transient) <= TRANSIENT_5XX, transient
    return seen


def _assert_spread(seen: list[tuple[str, str, int]], operations: int) -> None:
    """The cases reached at least `operations` operations and drew successes and
    refusals. (Schema-valid chat bodies are mostly refused all the same: a `tool`
    message without `tool_call_id`, both `prompt` and `messages` on /tokenize; the
    schema cannot say so.)"""
    reached = {(m, p) for m, p, _ in seen}
    assert len(reached) >= operations, reached
    assert any(s < 300 for *_, s in seen) and any(400 <= s < 500 for *_, s in seen), seen


@pytest.mark.parametrize("target", ["worker", "router", "serve"])
def test_fuzz_the_openai_endpoints(stack: Stack, target: str) -> None:
    """Worker: its own document + bodies. Router and serve: their documents (admin
    routes fuzzed without the key: all 401) + the worker's bodies on the routed paths."""
    process: Process = getattr(stack, target)
    doc = with_bodies(live_doc(process), body_models())
    for path in ("/health", "/v1/models", "/metrics"):  # served, but not in the router's doc
        doc["paths"].setdefault(path, {"get": {"responses": {"200": {"description": "OK"}}}})
    headers = {"authorization": f"Bearer {stack.key}"} if target == "serve" else {}
    seen = fuzz(doc, process.url, headers, stack)
    _assert_spread(seen, 3)
    # without the key no admin request gets through: 401, or 404 where a fuzzed path
    # parameter (a '?', '#' or '/' in a pool name) makes the URL match no route at all
    admin = [x for x in seen if x[1].startswith("/admin")]
    assert all(s in (401, 404) for *_, s in admin), [x for x in admin if x[2] not in (401, 404)]
    assert process.healthy(), process.text()


def test_fuzz_the_gateway_admin_api(stack: Stack, tmp_path: Path) -> None:
    """With the admin key, so that bodies and parameters reach the handlers and the
    store (tenants and keys with random settings are created on the serve process)."""
    doc = gateway_admin_doc(tmp_path)
    seen = fuzz(doc, stack.serve.url, {"authorization": f"Bearer {ADMIN_KEY}"}, stack,
                skip=frozenset({"/v1/usage"}))
    _assert_spread(seen, 2)
    fuzz({**doc, "paths": {"/v1/usage": doc["paths"]["/v1/usage"]}}, stack.serve.url,
         {"authorization": f"Bearer {stack.key}"}, stack)
    assert stack.serve.healthy(), stack.serve.text()
