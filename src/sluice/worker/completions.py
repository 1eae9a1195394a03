"""POST /v1/completions: one or more prompts (text or token ids), n choices each.

Choice indices follow OpenAI: prompt `p`'s choice `i` is index `p * n + i`. `echo`
prepends the prompt text to each choice, and with `logprobs` the prompt tokens' logprobs
(the first null) to its logprobs: how evaluation harnesses score a text (lm-evaluation-
harness's loglikelihood: token ids in, `echo`, `logprobs: 1`, `max_tokens` 0 or 1).
`max_tokens: 0` with `echo` answers the prompt alone, as OpenAI's API and vLLM do.
vLLM's `prompt_logprobs` puts them in each choice's `prompt_logprobs` instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    now,
    prompt_scoring,
)
from sluice.protocol.prompt import IdsHint, encode_prompt
from sluice.worker.chat import token_ids
from sluice.worker.generation import Run
from sluice.worker.logprobs import completion_logprobs, prompt_logprobs
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
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # vLLM's field, when asked


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
    generate: bool = True  # False: echo with max_tokens 0 (the engine's one token dropped)
    # by prompt index: its ids and prompt logprobs, from its first output
    prompts: dict[int, tuple[list[int], list[TokenLogprobs | None] | None]] = field(
        default_factory=dict)

    def usage(self) -> UsageInfo:
        prompt = sum(self.run.prompt_lens)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=self.completion_tokens,
                         total_tokens=prompt + self.completion_tokens,
                         prompt_tokens_details={"cached_tokens": sum(self.cached_tokens.values())})

    def seen(self, prompt_index: int, out: RequestOutput) -> None:
        """Note a prompt's first output: its ids and prompt logprobs (sent once)."""
        self.cached_tokens[prompt_index] = out.num_cached_tokens
        if prompt_index not in self.prompts:
            self.prompts[prompt_index] = (out.prompt_token_ids, out.prompt_logprobs)

    def step(self, prompt_index: int, c: CompletionOutput) -> tuple[int, str,
                                                                     CompletionLogprobs | None]:
        """Account one delta; returns (choice index, text to emit, logprobs to emit)."""
        index = prompt_index * self.req.n + c.index
        choice = self.choices.get(index)
        if not self.generate:  # the engine's one token is not the client's (a fresh
            c.text, c.token_ids = "", []  # output each delta: changing it is safe)
            c.logprobs = [] if c.logprobs is not None else None
        text, offset, lp = c.text, 0, None
        tokenizer = self.state.require_engine().tokenizer
        if choice is None:
            choice = self.choices[index] = _Choice()
            prompt_ids, prompt_entries = self.prompts[prompt_index]
            if self.req.echo:
                if self.req.logprobs is not None and prompt_entries is not None:
                    lp = completion_logprobs(tokenizer, prompt_ids, prompt_entries,
                                             self.req.logprobs, 0)
                echoed = self.prompt_text(prompt_index, prompt_ids)
                text, offset = echoed + text, len(echoed)
            if self.req.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_entries
        if self.req.logprobs is not None and c.logprobs is not None:
            generated = completion_logprobs(tokenizer, c.token_ids, c.logprobs,
                                            self.req.logprobs, choice.length + offset)
            lp = generated if lp is None else _extend(lp, generated)
        if lp is not None:
            choice.logprobs = _extend(choice.logprobs, lp)
        choice.text.append(text)
        choice.length += len(text)
        self.completion_tokens += len(c.token_ids)
        if c.finish_reason:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        return index, text, lp

    def prompt_text(self, prompt_index: int, prompt_ids: list[int]) -> str:
        """The prompt as echoed: the client's text, or the text of the ids the engine read
        where `truncate_prompt_tokens` cut it."""
        if self.req.truncate_prompt_tokens is None:
            return self.prompt_texts[prompt_index]
        tokenizer = self.state.require_engine().tokenizer
        return tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def choice_extra(self, choice: _Choice) -> dict[str, Any]:
        """vLLM's per-choice `prompt_logprobs`, when asked for."""
        if self.req.prompt_logprobs is None or choice.prompt_logprobs is None:
            return {}
        tokenizer = self.state.require_engine().tokenizer
        return {"prompt_logprobs": prompt_logprobs(tokenizer, choice.prompt_logprobs,
                                                   self.req.prompt_logprobs)}


def _extend(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs,
                              text_offset=a.text_offset + b.text_offset)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")


async def prepare_completion(state: WorkerState, req: CompletionRequest, request_id: str,
                             hint: IdsHint | None = None,
                             resumed: Sequence[int] | None = None) -> CompletionJob:
    """Validate, tokenize (or take the router's ids, `hint`, when they are this
    tokenizer's for this text) and admit; raises SluiceError subclasses.

    `resumed`: the output a migrated stream already sent; generation continues after it."""
    model = state.check_generates(req.model)
    engine = state.require_engine()
    _check_unsupported(req)
    if resumed is not None and (req.n != 1 or req.echo or len(req.prompts()) != 1
                                or not req.stream):
        raise InvalidRequestError("a resumed request must be a stream of one prompt, with "
                                  "n=1 and no echo", param="prompt")
    tok = engine.tokenizer
    # max_tokens left out is OpenAI's 16 here, as in vLLM: the model's max_new_tokens
    # applies to an explicit null only (its other defaults, to any field left out)
    generate = not (req.echo and req.max_tokens == 0)  # 0 with echo: the prompt alone
    prompt_lp = prompt_scoring(req.prompt_logprobs, req.echo, req.logprobs)
    params = sampling_params(req, req.max_tokens if generate else 1, req.logprobs,
                             tok.vocab_size, defaults=state.config.generation_defaults,
                             prompt_logprobs=prompt_lp)
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
                         completion_tokens=len(resumed or ()), generate=generate)


async def completion_response(job: CompletionJob) -> CompletionResponse:
    extra: dict[str, Any] = {}  # a P/D prefill's kv_transfer_params (vLLM's top-level field)
    async with job.run:
        async for p, out in job.run.outputs():
            job.seen(p, out)
            for c in out.outputs:
                job.step(p, c)
            if out.kv_transfer_params is not None:
                extra["kv_transfer_params"] = out.kv_transfer_params
    logprobs = job.req.logprobs is not None
    choices = [CompletionChoice(index=i, text="".join(ch.text),
                                logprobs=ch.logprobs if logprobs else None,
                                finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
                                **job.choice_extra(ch))
               for i, ch in sorted(job.choices.items())]
    return CompletionResponse(id=job.id, created=job.created, model=job.model,
                              choices=choices, usage=job.usage(), **extra)


async def completion_chunks(job: CompletionJob) -> AsyncIterator[CompletionResponse]:
    continuous = job.req.continuous_usage
    async with job.run:
        async for p, out in job.run.outputs():
            job.seen(p, out)
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
