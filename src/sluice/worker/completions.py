"""POST /v1/completions: one or more prompts (text or token ids), n choices each.

Choice indices follow OpenAI: prompt `p`'s choice `i` is index `p * n + i`. `echo`
prepends the prompt text to each choice (echo with logprobs would need prompt
logprobs, which the engine does not compute: refused with a 400).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.outputs import CompletionOutput
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
)
from sluice.protocol.prompt import IdsHint, encode_prompt
from sluice.worker.chat import token_ids
from sluice.worker.generation import Run
from sluice.worker.logprobs import completion_logprobs
from sluice.worker.pd import transfer_params
from sluice.worker.sampling import check_token_ids, sampling_params
from sluice.worker.state import WorkerState


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    length: int = 0  # characters so far, for logprobs text_offset
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class CompletionJob:
    req: CompletionRequest
    run: Run
    id: str
    model: str
    state: WorkerState
    prompt_texts: list[str]
    completion_tokens: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)  # by prompt index
    choices: dict[int, _Choice] = field(default_factory=dict)
    created: int = field(default_factory=now)  # one for every chunk, as vLLM's

    def usage(self) -> UsageInfo:
        prompt = sum(self.run.prompt_lens)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details={"cached_tokens": sum(self.cached_tokens.values())})

    def step(self, prompt_index: int, c: CompletionOutput) -> tuple[int, str,
                                                                     CompletionLogprobs | None]:
        """Account one delta; returns (choice index, text to emit, logprobs to emit)."""
        index = prompt_index * self.req.n + c.index
        choice = self.choices.get(index)
        text = c.text
        if choice is None:
            choice = self.choices[index] = _Choice()
            if self.req.echo:
                text = self.prompt_texts[prompt_index] + text
        lp = None
        if self.req.logprobs is not None and c.logprobs is not None:
            tokenizer = self.state.require_engine().tokenizer
            lp = completion_logprobs(tokenizer, c.token_ids, c.logprobs, self.req.logprobs,
                                     choice.length)
            choice.logprobs = _extend(choice.logprobs, lp)
        choice.text.append(text)
        choice.length += len(text)
        self.completion_tokens += len(c.token_ids)
        if c.finish_reason:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        return index, text, lp


def _extend(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    if req.echo and req.logprobs is not None:
        raise InvalidRequestError("echo together with logprobs (prompt logprobs) is not "
                                  "supported", param="echo")


async def prepare_completion(state: WorkerState, req: CompletionRequest, request_id: str,
                             hint: IdsHint | None = None,
                             resumed: Sequence[int] | None = None) -> CompletionJob:
    """Validate, tokenize (or take the router's ids, `hint`, when they are this
    tokenizer's for this text) and admit; raises SluiceError subclasses.

    `resumed`: the output a migrated stream already sent; generation continues after it."""
    model = state.check_model(req.model)
    engine = state.require_engine()
    _check_unsupported(req)
    if resumed is not None and (req.n != 1 or req.echo or len(req.prompts()) != 1
                                or not req.stream):
        raise InvalidRequestError("a resumed request must be a stream of one prompt, with "
                                  "n=1 and no echo", param="prompt")
    tok = engine.tokenizer
    # max_tokens left out is OpenAI's 16 here, as in vLLM: the model's max_new_tokens
    # applies to an explicit null only (its other defaults, to any field left out)
    params = sampling_params(req, req.max_tokens, req.logprobs, tok.vocab_size,
                             defaults=state.config.generation_defaults)
    prompts: list[list[int]] = []
    texts: list[str] = []
    for p in req.prompts():
        if isinstance(p, str):
            prompts.append(await encode_prompt(tok, p, special=req.add_special_tokens, hint=hint))
            texts.append(p)
        else:
            prompts.append(check_token_ids(list(p), tok.vocab_size, "prompt"))
            texts.append(tok.decode(p, skip_special_tokens=False) if req.echo else "")
    if any(not ids for ids in prompts):
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    params.kv_transfer_params = transfer_params(req, len(prompts))
    run = await Run.start(state, prompts, params, request_id, req.priority, param="prompt",
                          resumed=resumed or (), lora=state.lora_for(req.model))
    return CompletionJob(req, run, f"cmpl-{request_id}", model, state, texts,
                         completion_tokens=len(resumed or ()))


async def completion_response(job: CompletionJob) -> CompletionResponse:
    extra: dict[str, Any] = {}  # a P/D prefill's kv_transfer_params (vLLM's top-level field)
    async with job.run:
        async for p, out in job.run.outputs():
            job.cached_tokens[p] = out.num_cached_tokens
            for c in out.outputs:
                job.step(p, c)
            if out.kv_transfer_params is not None:
                extra["kv_transfer_params"] = out.kv_transfer_params
    logprobs = job.req.logprobs is not None
    choices = [CompletionChoice(index=i, text="".join(ch.text),
                                logprobs=ch.logprobs if logprobs else None,
                                finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)
               for i, ch in sorted(job.choices.items())]
    return CompletionResponse(id=job.id, created=job.created, model=job.model,
                              choices=choices, usage=job.usage(), **extra)


async def completion_chunks(job: CompletionJob) -> AsyncIterator[CompletionResponse]:
    continuous = job.req.continuous_usage
    async with job.run:
        async for p, out in job.run.outputs():
            job.cached_tokens[p] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                index, text, lp = job.step(p, c)
                if text or c.finish_reason or c.token_ids:
                    choices.append(CompletionChoice(index=index, text=text, logprobs=lp,
                                                    finish_reason=c.finish_reason,
                                                    stop_reason=c.stop_reason,
                                                    **token_ids(job.req.return_token_ids, c)))
            if choices:
                yield CompletionResponse(id=job.id, created=job.created, model=job.model,
                                         choices=choices,
                                         usage=job.usage() if continuous else None)
    if job.req.include_usage:
        yield CompletionResponse(id=job.id, created=job.created, model=job.model, choices=[],
                                 usage=job.usage())
