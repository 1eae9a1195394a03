"""POST /v1/embeddings, /v1/score, /v1/rerank, /classify and /pooling: OpenAI's
embeddings API, and vLLM's scoring, classification and pooling APIs, served as vLLM
pools a model.

Each input (a text, or a list of token ids) is one engine request that computes its
prompt and samples nothing (`AsyncEngine.embed`, `EngineCore._embed`): its final hidden
states pooled as the engine's pooler says (sluice.engine.pooling; a decoder's default:
the last token's, L2-normalized, vLLM's `LAST`) are the embedding. A text is tokenized
as a completion prompt is (the tokenizer's special tokens unless `add_special_tokens`
is false, no chat template); vLLM's chat form, `messages` instead of `input`, is one
conversation templated as a chat request's (no assistant opening, no added special
tokens, by default). The request's `truncate_prompt_tokens` and `use_activation` ride
to the engine as its PoolingParams. The inputs of one request run concurrently (they
batch in the engine); one that fails aborts the others.
`encoding_format: base64` sends each vector's little-endian float32 bytes as base64
(the OpenAI SDK asks for it by default). `dimensions` cuts each embedding to its first
`dimensions` values, normalized again, for a Matryoshka model (config.json's
`matryoshka_dimensions`, the sizes allowed, or `is_matryoshka`: any; `--hf-overrides`
adds either); refused for another model (vLLM's rule: cut, it would embed poorly), as is
a LoRA adapter's name as `model`.

`/v1/score` and `/v1/rerank` embed their texts the same way and answer the cosine of
two embeddings, as vLLM does for an embedding
model: `text_1` against each `text_2` (or pairwise), and the `documents` ordered by
their score against the `query` (the Jina / Cohere rerank API: `top_n`,
`relevance_score`). Usage counts every text embedded. On a cross-encoder (a one-label
`*ForSequenceClassification`: a reranker) each pair is one input, the two texts joined
by the tokenizer's pair template, and its score is the model's own (in (0, 1)); usage
then counts each pair's tokens. A classifier (any `*ForSequenceClassification`)
refuses `/v1/embeddings` and answers vLLM's `/classify` (also `/v1/classify`): each
input's label scores (`probs`), the best one's name (`label`) and `num_classes`.
vLLM's `/pooling` answers any of the model's tasks by name (`task`: embed, classify,
or per prompt token, token_embed and token_classify).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from sluice.engine.outputs import EmbeddingRequestOutput
from sluice.engine.pooling import unit_rows
from sluice.engine.pooling_params import PoolingParams
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingInputs,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    check_continue,
    now,
)
from sluice.protocol.prompt import INLINE_TOKENIZE_CHARS, IdsHint, encode_prompt
from sluice.worker.sampling import chat_prompt, check_token_ids
from sluice.worker.state import WorkerState


async def embeddings(state: WorkerState, req: EmbeddingRequest, request_id: str,
                     hint: IdsHint | None = None) -> dict[str, Any]:
    """The response; `hint`: the prompt ids the gateway or router computed, taken when
    they are this tokenizer's for this text."""
    model = _base_model(state, req.model)
    if state.require_engine().info.labels:
        raise InvalidRequestError(f"the model {model!r} is a classifier: it answers "
                                  "/classify (and a one-label one /v1/score and /v1/rerank), "
                                  "and has no embeddings", param="model")
    if req.dimensions is not None:
        _check_dimensions(state, model, req.dimensions)
    inputs, param = await _inputs(state, req, hint)
    pooling = PoolingParams(req.truncate_prompt_tokens, req.wants_activation("normalize"))
    outputs = await _embed_all(state, inputs, request_id, [param] * len(inputs), hint,
                               pooling, req.priority, req.special_tokens())
    normalize = pooling.use_activation is not False
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(_cut(o.data, req.dimensions, normalize), req)}
                     for i, o in enumerate(outputs)],
            "usage": _usage(outputs)}


def _check_dimensions(state: WorkerState, model: str, dimensions: int) -> None:
    """`dimensions` is a size this model's embeddings may be cut to (vLLM's checks)."""
    info = state.require_engine().info
    allowed = info.matryoshka_dimensions
    if allowed is None:
        raise InvalidRequestError(f"model {model!r} is not a Matryoshka embedding model: cut "
                                  "to other dimensions its embeddings would be poor",
                                  param="dimensions")
    if dimensions < 1:
        raise InvalidRequestError("dimensions must be at least 1", param="dimensions")
    if allowed and dimensions not in allowed:
        raise InvalidRequestError(f"model {model!r} is trained for dimensions "
                                  f"{list(allowed)}, not {dimensions}", param="dimensions")
    if dimensions > info.hidden_size:
        raise InvalidRequestError(f"dimensions {dimensions} exceeds the embedding's "
                                  f"{info.hidden_size}", param="dimensions")


def _cut(data: bytes, dimensions: int | None, normalize: bool) -> bytes:
    """An embedding's float32 bytes cut to its first `dimensions` values, L2-normalized
    again unless the request turned the activation off (all of it for None)."""
    if dimensions is None:
        return data
    head = np.frombuffer(data, dtype="<f4")[:dimensions]
    if not normalize:
        return head.tobytes()
    return (head / max(float(np.linalg.norm(head)), 1e-12)).astype("<f4").tobytes()


async def score(state: WorkerState, req: ScoreRequest, request_id: str,
                hint: IdsHint | None = None) -> dict[str, Any]:
    model = _base_model(state, req.model)
    left, right, pairs = req.pairs()
    pooling = PoolingParams(req.truncate_prompt_tokens, req.wants_activation("activation"))
    if _cross_encoder(state, model):
        scored = await _score_pairs(state, [(left[i], right[j]) for i, j in pairs],
                                    request_id, ("text_1", "text_2"), pooling, req.priority)
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": now(),
                "model": model,
                "data": [{"index": k, "object": "score", "score": float(_matrix([o])[0, 0])}
                         for k, o in enumerate(scored)],
                "usage": _usage(scored)}
    vectors = await _embed_all(state, [*left, *right], request_id,
                               ["text_1"] * len(left) + ["text_2"] * len(right), hint,
                               pooling, req.priority)
    a, b = unit_rows(_matrix(vectors[:len(left)])), unit_rows(_matrix(vectors[len(left):]))
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model,
            "data": [{"index": k, "object": "score", "score": float(a[i] @ b[j])}
                     for k, (i, j) in enumerate(pairs)],
            "usage": _usage(vectors)}


async def rerank(state: WorkerState, req: RerankRequest, request_id: str,
                 hint: IdsHint | None = None) -> dict[str, Any]:
    model = _base_model(state, req.model)
    req.check()
    pooling = PoolingParams(req.truncate_prompt_tokens, req.wants_activation("activation"))
    if _cross_encoder(state, model):
        vectors = await _score_pairs(state, [(req.query, d) for d in req.documents],
                                     request_id, ("query", "documents"), pooling, req.priority)
        scores = _matrix(vectors)[:, 0]
    else:
        vectors = await _embed_all(state, [req.query, *req.documents], request_id,
                                   ["query"] + ["documents"] * len(req.documents), hint,
                                   pooling, req.priority)
        scores = unit_rows(_matrix(vectors[1:])) @ unit_rows(_matrix(vectors[:1]))[0]
    order = sorted(range(len(req.documents)), key=lambda i: -scores[i])[:req.top_n]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": _usage(vectors),
            "results": [{"index": i, "relevance_score": float(scores[i]),
                         **({"document": {"text": req.documents[i]}}
                            if req.return_documents else {})} for i in order]}


async def classify(state: WorkerState, req: ClassificationRequest, request_id: str,
                   hint: IdsHint | None = None) -> dict[str, Any]:
    """vLLM's `/classify`: each input's scores over a classifier's labels."""
    model = _base_model(state, req.model)
    labels = state.require_engine().info.labels
    if not labels:
        raise InvalidRequestError(f"the model {model!r} is not a classification model (a "
                                  "*ForSequenceClassification checkpoint)", param="model")
    inputs, param = await _inputs(state, req, hint)
    outputs = await _embed_all(state, inputs, request_id, [param] * len(inputs), hint,
                               PoolingParams(req.truncate_prompt_tokens,
                                             req.wants_activation("activation")), req.priority,
                               req.special_tokens())
    data = []
    for i, out in enumerate(outputs):
        probs = np.frombuffer(out.data, dtype="<f4")
        data.append({"index": i, "label": labels[int(probs.argmax())],
                     "probs": probs.tolist(), "num_classes": len(labels)})
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model, "data": data, "usage": _usage(outputs)}


async def _inputs(state: WorkerState, req: PoolingInputs, hint: IdsHint | None
                  ) -> tuple[list[str | list[int]], str]:
    """The request's inputs and the parameter they are named by: its `input` items, or
    its conversation templated and tokenized as one input (vLLM's chat form)."""
    items = req.inputs()
    if items:
        return items, "input"
    assert req.messages is not None
    check_continue(req.continue_final_message, req.add_generation_prompt)
    tok = state.require_engine().tokenizer
    prompt = chat_prompt(tok, req.messages, req.add_generation_prompt, None,
                         req.continue_final_message, req.chat_template_kwargs)
    return [await encode_prompt(tok, prompt, special=req.special_tokens(), hint=hint)], \
        "messages"


async def pooling(state: WorkerState, req: PoolingRequest, request_id: str,
                  hint: IdsHint | None = None) -> dict[str, Any]:
    """vLLM's `/pooling`: each input's pooled data as its `task` asks (a vector, or one row
    a prompt token for a token task); a task the model lacks is a 400 naming `task`."""
    model = _base_model(state, req.model)
    task = req.task or ("classify" if state.require_engine().info.labels else "embed")
    params = PoolingParams(req.truncate_prompt_tokens, req.use_activation, task)
    inputs, param = await _inputs(state, req, hint)
    outputs = await _embed_all(state, inputs, request_id, [param] * len(inputs), hint, params,
                               req.priority, req.special_tokens())
    return {"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model,
            "data": [{"index": i, "object": "pooling",
                      "data": _pooled(o, params.token_level, req.encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": _usage(outputs)}


def _pooled(out: EmbeddingRequestOutput, token_level: bool, encoding: str) -> Any:
    """An output's data as `/pooling` sends it: base64 of its float32 bytes (one row a
    token after another), or the floats (a list of rows for a token task)."""
    if encoding == "base64":
        return base64.b64encode(out.data).decode("ascii")
    values = np.frombuffer(out.data, dtype="<f4")
    return values.reshape(len(out.prompt_token_ids), -1).tolist() if token_level \
        else values.tolist()


def _cross_encoder(state: WorkerState, model: str) -> bool:
    """Whether pairs are scored by the model itself (one label); a 400 for a classifier
    of more labels (no one score of a pair)."""
    labels = state.require_engine().info.labels
    if len(labels) > 1:
        raise InvalidRequestError(f"the model {model!r} classifies into {len(labels)} labels; "
                                  "a pair's score needs one (a cross-encoder) or an "
                                  "embedding model", param="model")
    return bool(labels)


def _base_model(state: WorkerState, model: str | None) -> str:
    """The served name `model` asks for; a LoRA adapter's is a 400 (no pooled adapter)."""
    name = state.check_model(model)
    if state.lora_for(model) is not None:
        raise InvalidRequestError(f"embeddings are not served for the LoRA adapter {name!r}; "
                                  "name the base model", param="model")
    return name


async def _embed_all(state: WorkerState, inputs: list[str | list[int]], request_id: str,
                     params: list[str], hint: IdsHint | None = None,
                     pooling: PoolingParams | None = None, priority: int = 0,
                     special: bool = True) -> list[EmbeddingRequestOutput]:
    """Each input's embedding (as `pooling` asks; a text tokenized with the tokenizer's
    special tokens or not), in order, computed concurrently; a bad input is a 400 naming
    its parameter (`params`, one an input), and one that fails (or a client that leaves)
    aborts the others."""
    engine = state.require_engine()
    timer = state.metrics.timer()
    tok = engine.tokenizer
    prompts = [await encode_prompt(tok, x, special=special, hint=hint) if isinstance(x, str)
               else check_token_ids(x, tok.vocab_size, param)
               for x, param in zip(inputs, params, strict=True)]
    empty = next((param for ids, param in zip(prompts, params, strict=True) if not ids), None)
    if empty is not None:
        raise InvalidRequestError("a text to embed must not be empty", param=empty)
    tasks = [asyncio.ensure_future(engine.embed(ids, f"{request_id}-{i}", priority, param,
                                                pooling))
             for i, (ids, param) in enumerate(zip(prompts, params, strict=True))]
    try:
        outputs = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
    for out in outputs:  # vLLM's request metrics: an embedding generates nothing
        timer.request_tokens(len(out.prompt_token_ids), 0)
    timer.finished(["stop"] * len(outputs))
    return outputs


async def _score_pairs(state: WorkerState, pairs: list[tuple[str, str]], request_id: str,
                       params: tuple[str, str], pooling: PoolingParams, priority: int
                       ) -> list[EmbeddingRequestOutput]:
    """A cross-encoder's output for each pair (one float: its score), in order; an empty
    text is a 400 naming its side's parameter. A pair's ids are truncated as one prompt
    (vLLM's rule)."""
    tok = state.require_engine().tokenizer
    for pair in pairs:
        for text, param in zip(pair, params, strict=True):
            if not text:
                raise InvalidRequestError("a text to score must not be empty", param=param)
    def encode() -> list[list[int]]:
        return [tok.encode_pair(first, second) for first, second in pairs]

    chars = sum(len(a) + len(b) for a, b in pairs)  # long texts: off the event loop
    ids = encode() if chars <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(encode)
    return await _embed_all(state, list(ids), request_id, [params[1]] * len(ids),
                            pooling=pooling, priority=priority)


def _usage(outputs: list[EmbeddingRequestOutput]) -> dict[str, int]:
    """Every text embedded counts, as prompt tokens (nothing is generated)."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}


def _matrix(outputs: list[EmbeddingRequestOutput]) -> np.ndarray:
    return np.stack([np.frombuffer(o.data, dtype="<f4") for o in outputs])


def _encode(data: bytes, req: EmbeddingRequest) -> list[float] | str:
    if req.encoding_format == "base64":
        return base64.b64encode(data).decode("ascii")
    return array("f", data).tolist()


# the routes answered here: the request model each reads, and its answer (`hint`: the
# prompt ids the gateway or router computed, taken when they are this tokenizer's)
Answer = tuple[type[Any], Callable[..., Awaitable[dict[str, Any]]]]
ROUTES: dict[str, Answer] = {"/v1/embeddings": (EmbeddingRequest, embeddings),
                             "/v1/score": (ScoreRequest, score),
                             "/v1/rerank": (RerankRequest, rerank),
                             "/v1/classify": (ClassificationRequest, classify),
                             "/classify": (ClassificationRequest, classify),
                             "/pooling": (PoolingRequest, pooling)}
