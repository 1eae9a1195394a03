"""POST /v1/chat/completions: template, tokenize, run, and shape the answer.

`prepare_chat` does everything that can fail with a 4xx/503 (model name, template,
sampling parameters, context length, admission) before the HTTP status is chosen;
then `chat_response` collects a whole answer or `chat_chunks` yields stream chunks.
The Anthropic endpoint reuses both through the translator in `sluice.protocol.anthropic`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.outputs import CompletionOutput
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCallOut,
    NamedToolChoice,
    ToolCallOut,
    UsageInfo,
    now,
)
from sluice.protocol.prompt import IdsHint, encode_prompt
from sluice.worker.generation import Run
from sluice.worker.logprobs import chat_logprobs, prompt_logprobs
from sluice.worker.pd import transfer_params
from sluice.worker.reasoning import ReasoningParser, ReasoningStream
from sluice.worker.sampling import chat_prompt, sampling_params
from sluice.worker.state import WorkerState
from sluice.worker.tool_parsers import (
    CallDelta,
    ToolCallStream,
    ToolParser,
    check_tool_schemas,
)


@dataclass
class ChatJob:
    """A chat request ready to stream: the admitted run and what shaping needs."""

    req: ChatCompletionRequest
    run: Run
    id: str
    model: str
    state: WorkerState
    num_logprobs: int | None
    tool_parser: ToolParser | None = None  # set when the output may hold tool calls
    completion_tokens: int = 0  # a resumed (migrated) request starts at the resumed count
    resumed: bool = False
    tools: _StreamedTools | None = None  # the stream's tool-call parsing, when it has tools
    # --reasoning-parser: None when the worker has none or the output is constrained (a
    # grammar from the first token leaves no room to think: all of it is the answer)
    reasoning: ReasoningParser | None = None
    reasoning_fields: bool = False  # the worker has a reasoning parser: messages say so
    thinking: dict[int, ReasoningStream] = field(default_factory=dict)  # by choice
    reasoning_tokens: int = 0  # generated tokens that said (or began) the thinking
    replayed: DeltaMessage | None = None  # what a resumed stream's output already said
    cached_tokens: int = 0
    # a request with a `prediction`: (accepted, rejected) prediction tokens by choice
    predicted: dict[int, tuple[int, int]] | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)
    created: int = field(default_factory=now)  # one for every chunk, as vLLM's

    @property
    def prompt_tokens(self) -> int:
        return self.run.prompt_lens[0]

    def usage(self) -> UsageInfo:
        counts: dict[str, int] = {}  # OpenAI's completion_tokens_details
        if self.reasoning_fields:  # (a worker with a parser)
            counts["reasoning_tokens"] = self.reasoning_tokens
        if self.predicted is not None:
            counts["accepted_prediction_tokens"] = sum(a for a, _ in self.predicted.values())
            counts["rejected_prediction_tokens"] = sum(r for _, r in self.predicted.values())
        details = {"completion_tokens_details": counts} if counts else {}
        return UsageInfo(prompt_tokens=self.prompt_tokens,
                         completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens,
                         prompt_tokens_details={"cached_tokens": self.cached_tokens},
                         **details)

    def count(self, c: CompletionOutput) -> None:
        """A choice's output: its tokens, and where it drafted from a prediction, the
        prediction tokens accepted and refused so far."""
        self.completion_tokens += len(c.token_ids)
        if self.predicted is not None:
            self.predicted[c.index] = (c.accepted_prediction_tokens,
                                       c.rejected_prediction_tokens)

    def split(self, c: CompletionOutput) -> tuple[str, str]:
        """A choice's next output as (reasoning, answer), delta by delta (the pieces join
        to the whole output's split); its tokens count as reasoning tokens when they said
        thinking or left the block still open."""
        if self.reasoning is None:
            return "", c.text
        stream = self.thinking.get(c.index) or self.thinking.setdefault(
            c.index, self.reasoning.stream())
        thought, text = stream.feed(c.text, bool(c.finish_reason))
        if thought or stream.thinking:
            self.reasoning_tokens += len(c.token_ids)
        return thought, text

    def logprobs(self, c: CompletionOutput) -> ChatLogprobs | None:
        if self.num_logprobs is None or c.logprobs is None:
            return None
        tokenizer = self.state.require_engine().tokenizer
        return chat_logprobs(tokenizer, c.token_ids, c.logprobs, self.num_logprobs)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)  # the answer (all of it without a parser)
    reasoning: list[str] = field(default_factory=list)  # the thinking (--reasoning-parser)
    logprobs: ChatLogprobs = field(default_factory=ChatLogprobs)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


async def prepare_chat(state: WorkerState, req: ChatCompletionRequest, request_id: str,
                       hint: IdsHint | None = None, resumed: Sequence[int] | None = None
                       ) -> ChatJob:
    """Validate, template, tokenize (or take the router's ids, `hint`, when they are
    this tokenizer's for this text) and admit; raises SluiceError subclasses.

    `resumed`: the output a migrated stream already sent (router's `x-sluice-resume-ids`):
    the same prompt is templated as before and generation continues after these ids."""
    if resumed is not None and (req.n != 1 or not req.stream):
        raise InvalidRequestError("a resumed request must be a stream with n=1",
                                  param="n" if req.n != 1 else "stream")
    model = state.check_generates(req.model)
    engine = state.require_engine()
    num_logprobs = req.num_logprobs()
    choice = req.effective_tool_choice()
    tools = [t.model_dump(exclude_unset=True) for t in req.tools] if req.tools else None
    forced = None
    if tools:
        check_tool_schemas(tools)
    if tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        forced = state.tool_parser.constraint(tools, name, req.parallel_tool_calls,
                                              engine.inputs.info.structured_outputs_backend)
    params = sampling_params(req, req.requested_max_tokens(), num_logprobs,
                             engine.tokenizer.vocab_size, forced,
                             state.config.generation_defaults, req.prompt_logprobs)
    params.kv_transfer_params = transfer_params(req, 1)
    if tools and choice != "none" and state.tool_parser.special_tokens:
        params.skip_special_tokens = False  # its calls begin with a special token (mistral)
    if req.prediction is not None:  # at most a context's worth of it can ever be drafted
        predicted = await encode_prompt(engine.tokenizer, req.prediction.text(), special=False)
        params.prediction = predicted[:engine.inputs.info.max_model_len] or None
    req.check_continue()
    prompt = chat_prompt(engine.tokenizer, req.messages, req.add_generation_prompt, tools,
                         req.continue_final_message, req.chat_template_kwargs)
    ids = await encode_prompt(engine.tokenizer, prompt, special=False, hint=hint)
    run = await Run.start(state, [ids], params, request_id, req.priority, param="messages",
                          resumed=resumed or (), lora=state.lora_for(req.model))
    parser = state.tool_parser if choice != "none" else None
    job = ChatJob(req, run, f"chatcmpl-{request_id}", model, state, num_logprobs, parser,
                  completion_tokens=len(resumed or ()), resumed=resumed is not None,
                  reasoning=state.reasoning_for(params),
                  reasoning_fields=state.reasoning_parser is not None,
                  predicted={} if req.prediction is not None else None)
    if parser is not None and req.stream:
        job.tools = _StreamedTools(parser, req.parallel_tool_calls)
    if resumed is not None:
        job.replayed = _replay(job, engine.tokenizer.decode(resumed, params.skip_special_tokens))
    return job


def _replay(job: ChatJob, text: str) -> DeltaMessage:
    """Feed a resumed stream's output so far through the tool-call parser, as the failed
    worker did, so the new worker's deltas go on where the client's stream stopped;
    returns what that output said, its thinking as `reasoning` (the Anthropic and
    Responses translators replay it too). A partial character at the end (U+FFFD from
    decoding) comes again with the next token."""
    text = text.rstrip("\ufffd")
    # (through the splitter and the parser, whose states follow the resumed text)
    thought, text = job.split(CompletionOutput(0, text, []))
    said = DeltaMessage(content=text) if job.tools is None else \
        job.tools.feed(0, text, finished=False)
    return DeltaMessage.model_validate({**said.model_dump(exclude_none=True),
                                        "reasoning": thought or None})


async def chat_response(job: ChatJob) -> ChatCompletionResponse:
    """Run to completion and build the whole response."""
    extra: dict[str, Any] = {}  # vLLM's top-level fields: a P/D prefill's
    #                             kv_transfer_params, the prompt_logprobs asked for
    async with job.run:
        async for _, out in job.run.outputs():
            job.cached_tokens = out.num_cached_tokens
            for c in out.outputs:
                _accumulate(job, c)
            if out.kv_transfer_params is not None:
                extra["kv_transfer_params"] = out.kv_transfer_params
            if out.prompt_logprobs is not None and job.req.prompt_logprobs is not None:
                extra["prompt_logprobs"] = prompt_logprobs(
                    job.state.require_engine().tokenizer, out.prompt_logprobs,
                    job.req.prompt_logprobs)
    choices = [_whole_choice(job, i, ch) for i, ch in sorted(job.choices.items())]
    return ChatCompletionResponse(id=job.id, created=job.created, model=job.model,
                                  choices=choices, usage=job.usage(), **extra)


def _whole_choice(job: ChatJob, index: int, ch: _Choice) -> ChatChoice:
    content: str | None = "".join(ch.text)
    reasoning = "".join(ch.reasoning) or None
    if job.reasoning is not None:
        content = content or None
    calls = None
    if job.tool_parser is not None:
        content, parsed = job.tool_parser.extract(content or "")
        if not job.req.parallel_tool_calls:  # `auto` is not forced: keep the first call
            parsed = parsed[:1]
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                 for c in parsed] or None
    message = AssistantMessage(content=content, tool_calls=calls,
                               **_reasoning_fields(job, reasoning))
    return ChatChoice(index=index, message=message,
                      logprobs=ch.logprobs if job.num_logprobs is not None else None,
                      finish_reason=_finish(ch.finish_reason, bool(calls)),
                      stop_reason=ch.stop_reason)


def _reasoning_fields(job: ChatJob, reasoning: str | None) -> dict[str, Any]:
    """vLLM's `reasoning` and its earlier `reasoning_content` (DeepSeek's API, LiteLLM),
    on a worker with a reasoning parser; nothing on one without."""
    if not job.reasoning_fields:
        return {}
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def _finish(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` when a choice that ended normally called tools."""
    return "tool_calls" if called and reason == "stop" else reason


def _accumulate(job: ChatJob, c: CompletionOutput) -> None:
    choice = job.choices.setdefault(c.index, _Choice())
    thought, text = job.split(c)
    choice.reasoning.append(thought)
    choice.text.append(text)
    job.count(c)
    lp = job.logprobs(c)
    if lp is not None:
        choice.logprobs.content += lp.content
    if c.finish_reason:
        choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason


async def chat_chunks(job: ChatJob) -> AsyncIterator[ChatCompletionChunk]:
    """The stream: a role chunk per choice, content chunks, then optionally usage."""
    req, tools = job.req, job.tools
    async with job.run:
        for i in range(0 if job.resumed else req.n):  # a resumed stream was introduced
            yield _chunk(job, [ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                            content=""))])
        async for _, out in job.run.outputs():
            job.cached_tokens = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                job.count(c)
                if c.text or c.finish_reason or c.token_ids:
                    thought, text = job.split(c)
                    delta = (tools.feed(c.index, text, bool(c.finish_reason))
                             if tools is not None else DeltaMessage(content=text))
                    if thought:
                        delta = DeltaMessage(content=delta.content or None,
                                             tool_calls=delta.tool_calls,
                                             **_reasoning_fields(job, thought))
                    if not (delta.content or delta.tool_calls or c.finish_reason or thought
                            or job.num_logprobs is not None or tools is None
                            or req.return_token_ids):
                        continue  # text held back by the tool-call parser: nothing to say
                    called = tools is not None and c.index in tools.called
                    choices.append(ChatStreamChoice(
                        index=c.index, delta=delta, logprobs=job.logprobs(c),
                        finish_reason=_finish(c.finish_reason, called),
                        stop_reason=c.stop_reason, **token_ids(req.return_token_ids, c)))
            if choices:
                yield _chunk(job, choices)
    if req.include_usage:
        yield ChatCompletionChunk(id=job.id, created=job.created, model=job.model, choices=[],
                                  usage=job.usage())


@dataclass
class _StreamedTools:
    """Each choice's tool-call stream: text deltas in, content and tool-call deltas out."""

    parser: ToolParser
    parallel: bool  # False: calls after the first are dropped (`auto` is not forced)
    streams: dict[int, ToolCallStream] = field(default_factory=dict)
    called: set[int] = field(default_factory=set)

    def feed(self, index: int, text: str, finished: bool) -> DeltaMessage:
        """Choice `index`'s next output text as a delta (`finished`: its last)."""
        stream = self.streams.get(index) or self.streams.setdefault(index, self.parser.stream())
        text, calls = stream.feed(text)
        if finished:
            rest, more = stream.finish()
            text, calls = text + rest, calls + more
        if not self.parallel:
            calls = [d for d in calls if d.index == 0]
        if calls:
            self.called.add(index)
        return DeltaMessage(content=text if text or not calls else None,
                            tool_calls=[_delta_call(d) for d in calls] or None)


def _delta_call(d: CallDelta) -> DeltaToolCall:
    if d.name is not None:
        return DeltaToolCall(index=d.index, id=d.id, type="function",
                             function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
    return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))


def token_ids(wanted: bool, c: CompletionOutput) -> dict[str, Any]:
    """vLLM's `token_ids` of a streamed choice, when the request asked (`return_token_ids`);
    absent otherwise, so other clients see the same chunks as before."""
    return {"token_ids": list(c.token_ids)} if wanted else {}


def _chunk(job: ChatJob, choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
    usage = job.usage() if job.req.continuous_usage else None
    return ChatCompletionChunk(id=job.id, created=job.created, model=job.model,
                               choices=choices, usage=usage)
