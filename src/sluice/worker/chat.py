"""POST /v1/chat/completions: template, tokenize, run, and shape the answer.

`prepare_chat` does everything that can fail with a 4xx/503 (model name, template,
sampling parameters, context length, admission) before the HTTP status is chosen;
then `chat_response` collects a whole answer or `chat_chunks` yields stream chunks.
The Anthropic endpoint reuses both through the translator in `sluice.protocol.anthropic`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sluice.engine.outputs import CompletionOutput
from sluice.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from sluice.protocol.prompt import IdsHint, encode_prompt
from sluice.worker.generation import Run
from sluice.worker.logprobs import chat_logprobs
from sluice.worker.sampling import chat_prompt, sampling_params
from sluice.worker.state import WorkerState


@dataclass
class ChatJob:
    """A chat request ready to stream: the admitted run and what shaping needs."""

    req: ChatCompletionRequest
    run: Run
    id: str
    model: str
    state: WorkerState
    num_logprobs: int | None
    completion_tokens: int = 0
    cached_tokens: int = 0
    choices: dict[int, _Choice] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return self.run.prompt_lens[0]

    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens,
                         completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens,
                         prompt_tokens_details={"cached_tokens": self.cached_tokens})

    def logprobs(self, c: CompletionOutput) -> ChatLogprobs | None:
        if self.num_logprobs is None or c.logprobs is None:
            return None
        tokenizer = self.state.require_engine().tokenizer
        return chat_logprobs(tokenizer, c.token_ids, c.logprobs, self.num_logprobs)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: ChatLogprobs = field(default_factory=ChatLogprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def prepare_chat(state: WorkerState, req: ChatCompletionRequest, request_id: str,
                       hint: IdsHint | None = None) -> ChatJob:
    """Validate, template, tokenize (or take the router's ids, `hint`, when they are
    this tokenizer's for this text) and admit; raises SluiceError subclasses."""
    model = state.check_model(req.model)
    engine = state.require_engine()
    num_logprobs = req.num_logprobs()
    params = sampling_params(req, req.requested_max_tokens(), num_logprobs)
    prompt = chat_prompt(engine.tokenizer, req.messages, req.add_generation_prompt)
    ids = await encode_prompt(engine.tokenizer, prompt, special=False, hint=hint)
    run = await Run.start(state, [ids], params, request_id, req.priority, param="messages")
    return ChatJob(req, run, f"chatcmpl-{request_id}", model, state, num_logprobs)


async def chat_response(job: ChatJob) -> ChatCompletionResponse:
    """Run to completion and build the whole response."""
    async with job.run:
        async for _, out in job.run.outputs():
            job.cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                _accumulate(job, c)
    choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(ch.text)),
                          logprobs=ch.logprobs if job.num_logprobs is not None else None,
                          finish_reason=ch.finish_reason, stop_reason=ch.stop_reason)
               for i, ch in sorted(job.choices.items())]
    return ChatCompletionResponse(id=job.id, model=job.model, choices=choices, usage=job.usage())


def _accumulate(job: ChatJob, c: CompletionOutput) -> None:
    choice = job.choices.setdefault(c.index, _Choice())
    choice.text.append(c.text)
    job.completion_tokens += len(c.token_ids)
    lp = job.logprobs(c)
    if lp is not None:
        choice.logprobs.content += lp.content
    if c.finish_reason:
        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason


async def chat_chunks(job: ChatJob) -> AsyncIterator[ChatCompletionChunk]:
    """The stream: a role chunk per choice, content chunks, then optionally usage."""
    req = job.req
    async with job.run:
        for i in range(req.n):
            yield _chunk(job, [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                            content=""))])
        async for _, out in job.run.outputs():
            job.cached_tokens = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                job.completion_tokens += len(c.token_ids)
                if c.text or c.finish_reason or c.token_ids:
                    choices.append(ChatStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.text),
                        logprobs=job.logprobs(c), finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason))
            if choices:
                yield _chunk(job, choices)
    if req.include_usage:
        yield ChatCompletionChunk(id=job.id, model=job.model, choices=[], usage=job.usage())


def _chunk(job: ChatJob, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
    usage = job.usage() if job.req.continuous_usage else None
    return ChatCompletionChunk(id=job.id, model=job.model, choices=choices, usage=usage)
