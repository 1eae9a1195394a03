"""The front end's check of a request before the core sees it: tokens, lengths, KV room.

`InputProcessor.prepare` refuses a non-zero priority under fcfs (vLLM's rule: nothing
would read it), tokenizes a text prompt, checks token ids against the vocabulary, the
prompt plus `max_tokens` against the context length and the KV pool, a
structured-output constraint for syntax (no compile: that is the core's, off its loop),
and returns the `CoreRequest` the core queues. Every failure is an
`InvalidRequestError` / `ContextLengthError` naming the parameter, raised in the
caller's thread before anything is sent to the core, so an HTTP handler can answer
400 before it picks a status. Needs only the core's `CoreInfo` and a tokenizer: no
torch, no engine state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from sluice.engine.block_manager import blocks_needed
from sluice.engine.lora import LoRARequest
from sluice.engine.messages import CoreInfo, CoreRequest
from sluice.engine.pooling_params import TOKEN_LEVEL, PoolingParams
from sluice.engine.sampling_params import SamplingParams, is_integer
from sluice.engine.structured_output import check_constraint
from sluice.protocol.errors import ContextLengthError, InvalidRequestError


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class InputProcessor:
    def __init__(self, info: CoreInfo, tokenizer: Encoder) -> None:
        self.info = info
        self.tokenizer = tokenizer

    def prepare(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                priority: int = 0, arrival_time: float | None = None,
                resumed: Sequence[int] = (), lora: LoRARequest | None = None) -> CoreRequest:
        """`resumed`: tokens already generated for this request elsewhere (a migrated
        stream); the core appends them to the prompt as output and continues after them."""
        self.check_generates()
        self.check_priority(priority)
        ids = self.truncate(self.tokenize(prompt), params.truncate_prompt_tokens)
        max_tokens = self.check_lengths(len(ids), params)
        if resumed:
            if len(resumed) >= max_tokens:
                raise InvalidRequestError(f"{len(resumed)} resumed tokens leave no room in "
                                          f"max_tokens={max_tokens}", param="max_tokens")
            ids = ids + self.tokenize(list(resumed))
        if params.structured_outputs is not None:
            check_constraint(params.structured_outputs, self.info.structured_outputs_backend)
        self.check_param_token_ids(params)
        if params.thinking_token_budget is not None and not self.info.reasoning_parser:
            raise InvalidRequestError(
                "thinking_token_budget needs a reasoning model's parser, to tell its "
                "thinking (--reasoning-parser; offline, LLM(reasoning_parser=...))",
                param="thinking_token_budget")
        arrival = time.time() if arrival_time is None else arrival_time
        if lora is not None and not self.info.enable_lora:
            raise InvalidRequestError(f"the model {lora.lora_name!r} is a LoRA adapter, but LoRA "
                                      "is not enabled (--enable-lora; offline, "
                                      "LLM(enable_lora=True))", param="model")
        return CoreRequest(request_id, ids, params, priority, arrival, max_tokens, len(resumed),
                           lora)

    def prepare_pooling(self, request_id: str, prompt: str | list[int], priority: int = 0,
                        param: str = "input", pooling: PoolingParams | None = None
                        ) -> CoreRequest:
        """An embedding request: the prompt alone (cut as `pooling` says) must fit the
        context and the KV pool (no token is generated); errors name `param` (`input` on
        `/v1/embeddings`)."""
        pooling = pooling or PoolingParams()
        self.check_task(pooling.task)
        self.check_priority(priority)
        try:
            ids = self.tokenize(prompt)
        except InvalidRequestError as exc:
            raise InvalidRequestError(exc.message, param=param) from None
        ids = self.truncate(ids, pooling.truncate_prompt_tokens)
        limit, info = self.info.max_model_len, self.info
        if len(ids) > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids)} tokens in the input for embedding generation. Please "
                "reduce the length of the input.", param=param)
        need = blocks_needed(len(ids), info.block_size)
        if need > info.num_kv_blocks:
            raise InvalidRequestError(
                f"the input needs {need} KV cache blocks but the KV cache holds only "
                f"{info.num_kv_blocks} blocks of {info.block_size} tokens", param=param)
        return CoreRequest(request_id, ids, SamplingParams(max_tokens=1), priority, time.time(),
                           1, pooling=True, use_activation=pooling.use_activation,
                           pooling_type=TOKEN_LEVEL if pooling.token_level else "")

    def check_task(self, task: str | None) -> None:
        """A pooling task this model has (a 400 naming `task`): classify and
        token_classify need a classifier, embed and token_embed a model without one."""
        if task is None:
            return
        classifier = bool(self.info.labels)
        if task.endswith("classify") != classifier:
            raise InvalidRequestError(
                f"task {task!r} needs " + ("an embedding model; this model is a classifier"
                                           if classifier else "a classification model (a "
                                           "*ForSequenceClassification checkpoint)"),
                param="task")

    def check_generates(self) -> None:
        """A 400 naming `model` where the core's model is a pooling model (an encoder, a
        bidirectional decoder or a classifier: vLLM's "does not support" answer)."""
        if self.info.embedding_only:
            raise InvalidRequestError(
                f"the model {self.info.model_name!r} is a pooling model (embeddings, scores, "
                "classification): it serves /v1/embeddings, /v1/score, /v1/rerank and "
                "/classify, not generation", param="model")

    def check_priority(self, priority: int) -> None:
        """A priority other than 0 needs the priority policy: under fcfs the scheduler
        would ignore it, so it is refused as vLLM refuses it."""
        if priority != 0 and self.info.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"Got priority {priority} but Priority scheduling is not enabled "
                f"(this worker's scheduling_policy is {self.info.scheduling_policy})",
                param="priority")

    def check_param_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request's parameters name (`logit_bias`, `prediction`) are in
        the vocabulary."""
        vocab = self.info.vocab_size
        for param, ids in (("logit_bias", params.logit_bias or {}),
                           ("prediction", params.prediction or ())):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{param} token id {bad[0]} is out of vocabulary "
                                          f"range [0, {vocab})", param=param)

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens, special ones
        counted (-1: the context length; None: all of it); more than the context length
        is a 400 naming it, as in vLLM."""
        if keep is None:
            return ids
        limit = self.info.max_model_len
        if keep > limit:
            raise InvalidRequestError(f"truncate_prompt_tokens value ({keep}) is greater than "
                                      f"max_model_len ({limit}). Please, select a smaller "
                                      "truncation size.", param="truncate_prompt_tokens")
        return ids[-(limit if keep == -1 else keep):]

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            wrong = [t for t in prompt if not is_integer(t)]
            if wrong:  # int() would truncate 1.5 to 1 and turn "7" into 7
                raise InvalidRequestError(f"prompt token ids must be integers, got "
                                          f"{wrong[0]!r}", param="prompt")
            ids = [int(t) for t in prompt]
            vocab = self.info.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is out of vocabulary "
                                          f"range [0, {vocab})", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return ids

    def check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        """The effective max_tokens; raises if the request cannot fit."""
        limit = self.info.max_model_len
        if num_prompt >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {num_prompt} input tokens. Please reduce the length of the "
                "input messages.", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.", param="max_tokens")
        info = self.info
        need = blocks_needed(num_prompt + max_tokens - 1, info.block_size)
        if need > info.num_kv_blocks:
            raise InvalidRequestError(
                f"the request needs {need} KV cache blocks ({num_prompt} prompt + {max_tokens} "
                f"max_tokens) but the KV cache holds only {info.num_kv_blocks} blocks of "
                f"{info.block_size} tokens; reduce max_tokens or the prompt", param="max_tokens")
        return max_tokens
