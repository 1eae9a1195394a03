"""POST /v1/embeddings: OpenAI's embeddings API, served as vLLM pools a generative model.

Each input (a text, or a list of token ids) is one engine request that computes its
prompt and samples nothing (`AsyncEngine.embed`, `EngineCore._embed`): its last token's final hidden state
(after the model's last norm), L2-normalized, is the embedding. That is vLLM's `LAST`
pooling with `normalize`, what it gives a decoder-only model served for embeddings, and
how decoder-only embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) are read.
A text is tokenized as a completion prompt is (the tokenizer's special tokens, no chat
template). The inputs of one request run concurrently (they batch in the engine); one
that fails aborts the others. `encoding_format: base64` sends each vector's
little-endian float32 bytes as base64 (the OpenAI SDK asks for it by default).
Refused: `dimensions` (the model is not a Matryoshka one, vLLM's rule), a LoRA
adapter's name as `model`.
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from array import array
from typing import Any

from sluice.engine.outputs import EmbeddingRequestOutput
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import EmbeddingRequest, now
from sluice.protocol.prompt import IdsHint, encode_prompt
from sluice.worker.sampling import check_token_ids
from sluice.worker.state import WorkerState


async def embeddings(state: WorkerState, req: EmbeddingRequest, request_id: str,
                     hint: IdsHint | None = None) -> dict[str, Any]:
    """The response; `hint`: the prompt ids the gateway or router computed, taken when
    they are this tokenizer's for this text."""
    model = state.check_model(req.model)
    if state.lora_for(req.model) is not None:
        raise InvalidRequestError(f"embeddings are not served for the LoRA adapter {model!r}; "
                                  "name the base model", param="model")
    if req.dimensions is not None:
        raise InvalidRequestError("this model does not support `dimensions` (it is not a "
                                  "Matryoshka embedding model)", param="dimensions")
    engine = state.require_engine()
    tok = engine.tokenizer
    prompts = [await encode_prompt(tok, x, special=True, hint=hint) if isinstance(x, str)
               else check_token_ids(x, tok.vocab_size, "input") for x in req.inputs()]
    tasks = [asyncio.ensure_future(engine.embed(ids, f"{request_id}-{i}"))
             for i, ids in enumerate(prompts)]
    try:
        outputs: list[EmbeddingRequestOutput] = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one failed (or the client left): the others are aborted
            task.cancel()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": now(),
            "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(o.data, req)}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _encode(data: bytes, req: EmbeddingRequest) -> list[float] | str:
    if req.encoding_format == "base64":
        return base64.b64encode(data).decode("ascii")
    return array("f", data).tolist()
