"""The offline API, shaped like vLLM's `LLM`: give it prompts, get finished outputs.

    llm = LLM(max_num_seqs=64)                       # None: the default SmolLM2 GGUF
    outs = llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text

`sampling_params=None` is `get_default_sampling_params()`: SamplingParams() with the
model's generation_config.json defaults over it (`generation_config="auto"`, as vLLM's;
"vllm" leaves SamplingParams' own; sluice.engine.generation_config).

All prompts are queued at once and the engine is stepped until every one finishes, so
they share batches (continuous batching); results come back in prompt order. An argument
of the wrong shape is an `InvalidRequestError` naming it, raised before any prompt is
queued. `chat` templates conversations by the worker's rules (`protocol.prompt`), so a
conversation reads here as it does through `/v1/chat/completions`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch

from sluice.engine.config import EngineConfig
from sluice.engine.generation_config import model_defaults, overridden_warning
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.lora import LoRARequest
from sluice.engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
    ranked,
)
from sluice.engine.pooling import unit_rows
from sluice.engine.pooling_params import PoolingParams
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams, is_integer
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import check_continue
from sluice.protocol.prompt import CHAT, prompt_view, templated

# vLLM's prompt shapes: text, token ids, or a dict (`TextPrompt` {"prompt": ...},
# `TokensPrompt` {"prompt_token_ids": [...]}); one or a list of them
Prompt = str | list[int] | dict[str, Any]
Prompts = Prompt | Sequence[Prompt]
ParamsArg = SamplingParams | Sequence[SamplingParams] | None
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None
PoolingArg = PoolingParams | Sequence[PoolingParams] | None
Messages = list[dict[str, Any]]
Progress = bool | Callable[..., Any]  # use_tqdm: a bar or not, or a tqdm-like factory

log = logging.getLogger("sluice.engine")


class LLM:
    """One engine driven synchronously in the caller's thread. `shutdown()`, or leaving
    `with LLM(...) as llm:`, stops its threads; the model's memory goes with the object."""

    def __init__(self, model: str | os.PathLike[str] | None = None,
                 **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model, **engine_options)
        self.sampling_defaults = model_defaults(self.config.model)  # a bad file: raises here
        self.engine = LLMEngine(self.config)
        if self.sampling_defaults:
            log.warning(overridden_warning(self.sampling_defaults,
                                           "LLM(..., generation_config=\"vllm\")"))
        self._ids = itertools.count()
        self._closed = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the engine's threads (grammar compiles, KV offload writer, KV transfer
        server); later `generate` / `chat` calls raise. Idempotent."""
        if not self._closed:
            self._closed = True
            self.engine.core.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams with the model's generation_config.json defaults
        (`generation_config`; none: SamplingParams()); what `sampling_params=None` uses."""
        return SamplingParams(**self.sampling_defaults)

    def generate(self, prompts: Prompts, sampling_params: ParamsArg = None,
                 use_tqdm: Progress = False, lora_request: LoRAArg = None, *,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in order.
        `sampling_params`, `lora_request` (None: the base model) and `priority` (vLLM's:
        lower first; needs the `priority` scheduling policy, the default): one for all
        prompts, or one per prompt; `sampling_params=None`: `get_default_sampling_params()`."""
        items = _normalize_prompts(prompts)
        params = _per_prompt(sampling_params, len(items), "sampling_params", SamplingParams,
                             self.get_default_sampling_params())
        loras = _per_prompt(lora_request, len(items), "lora_request", LoRARequest, None)
        priorities = _priorities(priority, len(items))
        return self._run(self._add_all(items, params, loras, priorities), params, use_tqdm)

    def embed(self, prompts: Prompts, use_tqdm: Progress = False, *,
              priority: Sequence[int] | None = None, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingArg = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding (`outputs.embedding`), its final
        hidden states pooled as the engine's pooler says (docs/engine.md "Embeddings
        (pooling)"); in order. `pooling_params` (one for all, or one per prompt) and
        `truncate_prompt_tokens` (over theirs) as vLLM's. A classifier has none
        (`classify`)."""
        if self.engine.core.info.labels:
            raise InvalidRequestError("this model is a classifier: LLM.classify or LLM.score",
                                      param="model")
        items = _normalize_prompts(prompts)
        return self._pool(items, use_tqdm, priority,
                          _pooling(pooling_params, len(items), truncate_prompt_tokens))

    def encode(self, prompts: Prompts, use_tqdm: Progress = False, *,
               pooling_task: str | None = None, priority: Sequence[int] | None = None,
               truncate_prompt_tokens: int | None = None,
               pooling_params: PoolingArg = None) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: each prompt's pooled output as `pooling_task` (over
        `pooling_params`' task) asks: `embed`, `classify`, or per token `token_embed`,
        `token_classify` (`outputs.data` a float32 tensor of one row a prompt token);
        None: the model's task. In order."""
        items = _normalize_prompts(prompts)
        each = _pooling(pooling_params, len(items), truncate_prompt_tokens)
        if pooling_task is not None:
            each = [dataclasses.replace(p, task=pooling_task) for p in each]
        outs = self._pool(items, use_tqdm, priority, each)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, PoolingOutput(
            _tensor(o.data, len(o.prompt_token_ids) if p.token_level else None)))
            for o, p in zip(outs, each, strict=True)]

    def classify(self, prompts: Prompts, use_tqdm: Progress = False, *,
                 priority: Sequence[int] | None = None,
                 truncate_prompt_tokens: int | None = None,
                 pooling_params: PoolingArg = None) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify`: each prompt's scores over a classifier's labels
        (`outputs.probs`, in `id2label`'s order; its raw logits with
        `PoolingParams(use_activation=False)`); in order."""
        if not self.engine.core.info.labels:
            raise InvalidRequestError("this model is not a classification model (a "
                                      "*ForSequenceClassification checkpoint)", param="model")
        items = _normalize_prompts(prompts)
        pooled = self._pool(items, use_tqdm, priority,
                            _pooling(pooling_params, len(items), truncate_prompt_tokens))
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(o.outputs.embedding))
                for o in pooled]

    def score(self, data_1: str | list[str], data_2: str | list[str],
              use_tqdm: Progress = False, *, truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: `data_1` (one text, against each of `data_2`, or as many,
        pair by pair) scored against `data_2`: a cross-encoder's (one-label classifier's)
        own score of each pair, joined by the tokenizer's pair template (the pair's ids
        truncated as one prompt), or an embedding model's cosine of the two embeddings
        (each text truncated); in order."""
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(first) == 1:
            first = first * len(second)
        if not second or len(first) != len(second):
            raise InvalidRequestError(f"data_1 holds {len(first)} texts and data_2 "
                                      f"{len(second)}: give one data_1, or as many as data_2",
                                      param="data_2")
        labels = self.engine.core.info.labels
        if len(labels) > 1:
            raise InvalidRequestError(f"this model classifies into {len(labels)} labels; a "
                                      "pair's score needs one", param="model")
        if labels:
            tok = self.engine.tokenizer
            outs = self._pool([tok.encode_pair(a, b) for a, b in zip(first, second,
                                                                      strict=True)],
                              use_tqdm, None,
                              _pooling(pooling_params, len(first), truncate_prompt_tokens))
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids,
                                         ScoringOutput(o.outputs.embedding[0])) for o in outs]
        unique: list[str | list[int]] = list(dict.fromkeys(first))
        left = self._pool(unique, use_tqdm, None,
                          _pooling(pooling_params, len(unique), truncate_prompt_tokens))
        vectors = {text: o.outputs.embedding for text, o in zip(unique, left, strict=True)}
        right = self._pool(list(second), use_tqdm, None,
                           _pooling(pooling_params, len(second), truncate_prompt_tokens))
        a = unit_rows(np.asarray([vectors[text] for text in first]))
        b = unit_rows(np.asarray([o.outputs.embedding for o in right]))
        return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(float(c)))
                for o, c in zip(right, (a * b).sum(axis=1), strict=True)]

    def _pool(self, items: list[str | list[int]], use_tqdm: Progress,
              priority: Sequence[int] | None, pooling: list[PoolingParams]
              ) -> list[EmbeddingRequestOutput]:
        """Each item's pooled output (an embedding, or a classifier's scores), in order."""
        priorities = _priorities(priority, len(items))
        if self._closed:
            raise RuntimeError("this LLM was shut down")
        engine, ids = self.engine, [f"llm-{next(self._ids)}" for _ in items]
        bar = None
        try:
            for request_id, prompt, p, params in zip(ids, items, priorities, pooling,
                                                     strict=True):
                engine.add_embedding_request(request_id, prompt, p, params)
            bar = _progress(use_tqdm, len(ids))
            while engine.has_unfinished_requests() and any(i not in engine.embeddings
                                                            for i in ids):
                before = len(engine.embeddings)
                engine.step()
                if bar is not None:
                    bar.update(len(engine.embeddings) - before)
        except BaseException:
            for request_id in ids:
                if engine.embeddings.pop(request_id, None) is None:
                    engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [engine.embeddings.pop(i) for i in ids]

    def chat(self, messages: Messages | list[Messages], sampling_params: ParamsArg = None,
             use_tqdm: Progress = False, lora_request: LoRAArg = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to each conversation (one, or a list of them), then
        generate. Messages and `tools` take OpenAI's shapes, read by the worker's rules;
        `chat_template`: a Jinja template used instead of the model's;
        `chat_template_kwargs`: more variables for it (e.g. `enable_thinking`)."""
        check_continue(continue_final_message, add_generation_prompt)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, list):
            raise InvalidRequestError("messages must be a list of messages, or a list of "
                                      "conversations", param="messages")
        tok = self.engine.tokenizer
        if chat_template is not None:
            tok = dataclasses.replace(tok, chat_template=chat_template)
        body = {"tools": tools, "continue_final_message": continue_final_message,
                "add_generation_prompt": add_generation_prompt,
                "chat_template_kwargs": chat_template_kwargs}
        texts = [_templated(tok, {**body, "messages": c}) for c in conversations]
        prompts: list[Prompt] = [tok.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text  # the templated conversation, as vLLM's chat outputs carry
        return outputs

    def _add_all(self, prompts: list[str | list[int]], params: list[SamplingParams],
                  loras: list[LoRARequest | None], priorities: list[int]) -> list[str]:
        if self._closed:
            raise RuntimeError("this LLM was shut down")
        ids: list[str] = []
        try:
            for prompt, p, lora, priority in zip(prompts, params, loras, priorities,
                                                 strict=True):
                request_id = f"llm-{next(self._ids)}"
                final = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, final, priority=priority,
                                        lora_request=lora)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, ids: list[str], params: list[SamplingParams],
             use_tqdm: Progress) -> list[RequestOutput]:
        """Step until every request finishes; if a step raises (Ctrl-C, a constraint that
        failed to compile), the call's unfinished requests are aborted first."""
        done: dict[str, RequestOutput] = {}
        bar = None
        try:
            bar = _progress(use_tqdm, len(ids))
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:
                if request_id not in done:
                    self.engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._vllm_logprobs(done[i], p) for i, p in zip(ids, params, strict=True)]

    def _vllm_logprobs(self, out: RequestOutput, params: SamplingParams) -> RequestOutput:
        """Each logprob as a `Logprob`: a float with vLLM's `.logprob`, `.rank` and
        `.decoded_token` (ranked among the request's `logprobs` / `prompt_logprobs`)."""
        tok = self.engine.tokenizer

        def decode(t: int) -> str:
            return tok.decode([t], skip_special_tokens=False)

        top = params.logprobs
        for c in out.outputs:
            if c.logprobs is not None and top is not None:
                c.logprobs = [ranked(entry, top, decode) for entry in c.logprobs]
        if out.prompt_logprobs is not None:
            k = params.prompt_logprobs or 0
            out.prompt_logprobs = [None if entry is None else ranked(entry, k, decode)
                                   for entry in out.prompt_logprobs]
        return out


def _templated(tok: Any, body: dict[str, Any]) -> str:
    """One conversation through the worker's template rules; an error the model's own
    template raises (jinja2) is an InvalidRequestError naming `messages`."""
    view = prompt_view(CHAT, body)
    try:
        return templated(tok, view)
    except InvalidRequestError:
        raise
    except Exception as exc:
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc


def _normalize_prompts(prompts: Prompts) -> list[str | list[int]]:
    if isinstance(prompts, str | dict):
        return [_prompt(prompts)]
    if not _is_sequence(prompts):
        raise InvalidRequestError(
            f"prompts must be a string, a list of token ids, a prompt dict, or a list of "
            f"them; got {type(prompts).__name__}", param="prompts")
    items: list[Any] = list(prompts)
    if items and is_integer(items[0]):  # a single prompt given as token ids
        return [_prompt(items)]
    return [_prompt(p) for p in items]


def _prompt(prompt: Any) -> str | list[int]:
    """Text or token ids from one of vLLM's prompt shapes; an unsupported one (a dict
    with other keys, e.g. `multi_modal_data`) is an `InvalidRequestError` naming it.
    Token ids' own checks (integers, in the vocabulary) are the input processor's."""
    if isinstance(prompt, str):
        return prompt
    if _is_sequence(prompt):
        return list(prompt)
    if not isinstance(prompt, dict):
        raise InvalidRequestError(
            f"a prompt must be a string, a list of token ids or a prompt dict; got "
            f"{type(prompt).__name__}", param="prompts")
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and _is_sequence(prompt["prompt_token_ids"]):
        return list(prompt["prompt_token_ids"])
    extra = sorted(keys - {"prompt", "prompt_token_ids"})
    raise InvalidRequestError(
        f"unsupported prompt key {extra[0]!r}" if extra else
        "a prompt dict takes one of 'prompt' (a string) or 'prompt_token_ids' (a list of "
        "token ids)", param="prompt")


def _is_sequence(value: Any) -> bool:
    """A list, tuple, numpy array or generator of items; not text, bytes or a dict."""
    return not isinstance(value, str | bytes | dict) and hasattr(value, "__iter__")


def _per_prompt(value: Any, count: int, param: str, kind: type, default: Any) -> list[Any]:
    """`value` for every prompt: one (or None: `default`) for all, or a list of one per
    prompt; each a `kind` (or None, where `default` is None)."""
    if value is None or isinstance(value, kind):
        return [default if value is None else value] * count
    if not isinstance(value, list | tuple):
        raise InvalidRequestError(f"{param} must be a {kind.__name__} or a list of them, got "
                                  f"{type(value).__name__}", param=param)
    if len(value) != count:
        raise InvalidRequestError(f"got {len(value)} {param} for {count} prompts", param=param)
    wrong = [v for v in value if not (isinstance(v, kind) or v is None and default is None)]
    if wrong:
        raise InvalidRequestError(f"{param} must be a {kind.__name__} or a list of them, got "
                                  f"a {type(wrong[0]).__name__} in the list", param=param)
    return list(value)


def _pooling(value: PoolingArg, count: int, truncate_prompt_tokens: int | None
             ) -> list[PoolingParams]:
    """The PoolingParams of each of `count` prompts (`_per_prompt`'s rule), with
    `truncate_prompt_tokens` over theirs where given (vLLM's keyword)."""
    each = _per_prompt(value, count, "pooling_params", PoolingParams, PoolingParams())
    if truncate_prompt_tokens is None:
        return each
    return [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in each]


def _tensor(data: bytes, rows: int | None) -> torch.Tensor:
    """Float32 bytes as a tensor: one row a token where `rows` is given, else a vector."""
    vector = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return vector if rows is None else vector.reshape(rows, -1)


def _priorities(priority: Sequence[int] | None, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    if not isinstance(priority, list | tuple) or not all(is_integer(p) for p in priority):
        raise InvalidRequestError("priority must be a list of integers, one per prompt",
                                  param="priority")
    if len(priority) != count:
        raise InvalidRequestError(f"got {len(priority)} priorities for {count} prompts",
                                  param="priority")
    return [int(p) for p in priority]


def _progress(use_tqdm: Progress, total: int) -> Any:
    """A progress bar (None for none): tqdm's, or the caller's `tqdm`-like factory
    (vLLM's `use_tqdm` takes one too)."""
    if use_tqdm is False or use_tqdm is None:
        return None
    if use_tqdm is True:
        from tqdm import tqdm

        return tqdm(total=total, desc="Processed prompts")
    if not callable(use_tqdm):
        raise InvalidRequestError(f"use_tqdm must be True, False or a tqdm-like callable, "
                                  f"got {use_tqdm!r}", param="use_tqdm")
    return use_tqdm(total=total, desc="Processed prompts")
