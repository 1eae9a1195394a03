"""OpenAI wire types: chat completions, completions, models, tokenize/detokenize.

Requests are parsed in two passes so that every refusal names its parameter:

1. `reject_unsupported(body, table)` turns a parameter sluice knows but does not
   implement (audio, a `suffix`, `best_of`, ...) into a 400 with a message saying so,
   and drops the ones whose value asks for nothing (`"store": false`, `"suffix": null`);
2. `parse_request(Model, body)` validates with pydantic (`extra="forbid"`, strict
   types: `"10"` or `true` is not a number, as OpenAI's API has it), so an unknown
   field or a wrong type is a 400 naming the field (`messages.0.content`). A `null`
   for a field that has a default but cannot be null (`n`, `stream`, `logprobs`, ...)
   means the default, as it does for OpenAI.

Field names and shapes follow OpenAI, plus vLLM's extra sampling fields (`top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `priority`, ...) so that
clients written for vLLM work unchanged. Responses carry vLLM's `stop_reason` next to
`finish_reason` (the stop string or token id that ended the choice).
"""

from __future__ import annotations

import functools
import json
import time
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from sluice.protocol.errors import InvalidRequestError


class OpenAIModel(BaseModel):
    """Base of every request model: unknown fields are an error, never ignored; `null`
    for a field that has a default but cannot be None is that default."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and None in data.values():
            not_null = _defaults_not_null(cls)
            return {k: v for k, v in data.items() if v is not None or k not in not_null}
        return data


@functools.cache
def _defaults_not_null(cls: type[BaseModel]) -> frozenset[str]:
    """The field names (and aliases) of `cls` that have a default and do not admit None."""
    names: set[str] = set()
    for name, info in cls.model_fields.items():
        if not info.is_required() and not _admits_none(info.annotation):
            names.update(n for n in (name, info.alias) if n)
    return frozenset(names)


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    return any(_admits_none(a) for a in typing.get_args(annotation)
               if typing.get_origin(annotation) in (typing.Union, types.UnionType))


class ResponseModel(BaseModel):
    """Base of response models (lenient: they are built by us, and parsed by the gateway)."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- parsing

M = TypeVar("M", bound=BaseModel)

# A table of parameters sluice recognises but does not implement: name -> predicate
# that says whether the given value is harmless (e.g. response_format {"type": "text"}).
Acceptable = Callable[[Any], bool]


def _is_empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value is False


TEXT_PARTS = {"text": "text"}  # OpenAI chat's text parts (Anthropic's text blocks too)


def content_text(content: Any, param: str, kinds: Mapping[str, str] = TEXT_PARTS,
                 noun: str = "text parts", name_part: bool = False) -> str:
    """A message's content as the template sees it: a string, or a list of parts of the
    `kinds` (a part's type -> the field its text is in) joined without separator, as
    every API reads them (chat's text parts, Anthropic's text blocks, the Responses
    API's input and output text). Anything else is a 400 naming the content, or with
    `name_part` the part (`param.N`: the Responses API's; chat's and Anthropic's name
    the content, as their request models do): the model reads text only."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"content must be a string or a list of {noun}",
                                  param=param)
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        field = kinds.get(kind) if isinstance(part, Mapping) and isinstance(kind, str) \
            else None
        if field is None:
            raise InvalidRequestError(f"only {noun} are supported (the model reads text "
                                      f"only), got {kind!r}",
                                      param=f"{param}.{i}" if name_part else param)
        if not isinstance(part.get(field), str):
            raise InvalidRequestError(f"a {kind!r} part needs {field!r}, a string",
                                      param=f"{param}.{i}.{field}")
        parts.append(part[field])
    return "".join(parts)


def _text_only(value: Any) -> bool:
    return value is None or value == ["text"]


def _no_tools(value: Any) -> bool:
    return value is None or value == "none"


UNSUPPORTED_COMMON: dict[str, Acceptable] = {
    "guided_json": lambda v: v is None,
    "guided_regex": lambda v: v is None,
    "guided_choice": lambda v: v is None,
    "guided_grammar": lambda v: v is None,
    "lora_request": lambda v: v is None,
}

UNSUPPORTED_CHAT: dict[str, Acceptable] = {
    **UNSUPPORTED_COMMON,
    "functions": _is_empty,  # the legacy form of `tools`
    "function_call": _no_tools,
    "audio": lambda v: v is None,
    "modalities": _text_only,
    "web_search_options": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "store": lambda v: v is None or v is False,
    "metadata": _is_empty,
    "service_tier": lambda v: v is None or v in ("auto", "default"),
}

UNSUPPORTED_COMPLETION: dict[str, Acceptable] = {
    **UNSUPPORTED_COMMON,
    "suffix": lambda v: v is None or v == "",
}


# What replaces a refused parameter, where something does.
INSTEAD: dict[str, str] = {
    **{f"guided_{kind}": f'vLLM removed it: use structured_outputs: {{"{kind}": ...}}'
       for kind in ("json", "regex", "choice", "grammar")},
    # the Responses API's (protocol/responses.py), which need a stored response
    "previous_response_id": "this server stores no responses (the sluice gateway does: "
                            "`sluice serve`, `sluice gateway`): send the whole "
                            "conversation as input",
    "conversation": "this server stores no conversations (the sluice gateway does): "
                    "send the whole conversation as input",
    "background": "this server runs responses in the foreground only (the sluice "
                  "gateway runs them in the background)",
}


def reject_unsupported(body: Mapping[str, Any], table: Mapping[str, Acceptable]
                       ) -> dict[str, Any]:
    """Raise InvalidRequestError for the first parameter sluice does not implement; the
    body without the table's parameters (each one left asks for nothing)."""
    for name, acceptable in table.items():
        if name in body and not acceptable(body[name]):
            instead = f"; {INSTEAD[name]}" if name in INSTEAD else ""
            raise InvalidRequestError(
                f"'{name}' is not supported by this server (value {body[name]!r}){instead}",
                param=name)
    return {k: v for k, v in body.items() if k not in table}


def parse_request(model: type[M], body: Any) -> M:
    """Validate `body` as `model`; a failure is an InvalidRequestError naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> InvalidRequestError:
    """The first pydantic error as an InvalidRequestError with a dotted parameter name."""
    err = exc.errors()[0]
    param = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None
    if err["type"] == "extra_forbidden":
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}", param=param)
    if err["type"] == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'", param=param)
    return InvalidRequestError(f"Invalid value for '{param}': {err['msg']}", param=param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: str | int) -> bool:
    """pydantic puts the union member's type (`str`, `list[TextPart]`) into error locations."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn of tool calls
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns only
    tool_call_id: str | None = None  # tool turns only

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        for i, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (only 'text')")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"content part {i} is a text part without 'text', a string")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_dict(self, param: str = "messages") -> dict[str, Any]:
        """The dict a chat template expects (the one rule set: `protocol.prompt`); errors
        name `param` (`messages.N`)."""
        from sluice.protocol.prompt import template_message

        return template_message(self.model_dump(exclude_none=True), param)


# -- structured output and tools ---------------------------------------------------------

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # outputs always follow the schema (strict or not)


class LegacyStructuralTag(OpenAIModel):
    """One tag of vLLM's legacy structural-tag response format: a JSON value following
    `schema` between `begin` and `end`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(OpenAIModel):
    """OpenAI's `text` / `json_object` / `json_schema`, and vLLM's `structural_tag`: an
    xgrammar structural tag's `format`, or the legacy `structures` + `triggers` (free
    text until a trigger, then one of the tags). A field of another type is a 400."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructuralTag] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponseFormat:
        tag_fields = ("format", "structures", "triggers")
        given = [f for f in ("json_schema", *tag_fields) if getattr(self, f) is not None]
        allowed = {"json_schema": ("json_schema",), "structural_tag": tag_fields}.get(
            self.type, ())
        for name in given:
            if name not in allowed:
                raise ValueError(f"a response_format of type {self.type} takes no '{name}'")
        legacy = [f for f in ("structures", "triggers") if getattr(self, f) is not None]
        if self.type == "structural_tag" and len(legacy) != (0 if self.format else 2):
            raise ValueError("a response_format of type structural_tag takes either 'format' "
                             "or both 'structures' and 'triggers'")
        return self

    def structural_tag(self) -> str:
        """The structural tag as xgrammar's JSON (the legacy form as xgrammar converts it:
        `triggered_tags` of JSON-schema tags)."""
        fmt = self.format
        if fmt is None:
            fmt = {"type": "triggered_tags", "triggers": self.triggers, "tags": [
                {"type": "tag", "begin": s.begin, "end": s.end,
                 "content": {"type": "json_schema", "json_schema": s.schema_}}
                for s in self.structures or ()]}
        return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` extension: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


def prompt_scoring(prompt_logprobs: Any, echo: Any, logprobs: Any) -> Any:
    """How many of the likeliest tokens a request asks for at each prompt position (the
    prompt scored), from its fields: vLLM's `prompt_logprobs`, or completions' `echo`
    with `logprobs`; None when it asks for none. One rule for the worker (what it asks
    the engine) and the router (a P/D pool keeps such a request on one worker)."""
    if prompt_logprobs is not None:
        return prompt_logprobs
    return logprobs if echo else None


def function_tool(name: str, description: Any, parameters: Any, strict: Any) -> dict[str, Any]:
    """OpenAI's chat tool for a function, as the Anthropic and Responses translations
    make it: `description` and `strict` left out when None, the keys in the order the
    template writes them (name, description, parameters, strict)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


class ToolChoiceFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class KVTransferParams(OpenAIModel):
    """vLLM's `kv_transfer_params` for prefill/decode disaggregation (docs/pd.md):

    - to a prefill worker: `do_remote_decode: true`, the rest null; its response carries
      the params below with `do_remote_prefill: true`;
    - to a decode worker: those params unchanged; it pulls the prompt's KV blocks
      `remote_block_ids` of request `remote_request_id` from `remote_host:remote_port`.
    Types are strict (no "1" for 1); the worker checks what each side needs."""

    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    remote_engine_id: StrictStr | None = None
    remote_block_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    remote_host: StrictStr | None = None
    remote_port: Annotated[StrictInt, Field(ge=0, le=65535)] | None = None
    remote_request_id: StrictStr | None = None
    tp_size: Annotated[StrictInt, Field(ge=1)] = 1


# vLLM's `truncate_prompt_tokens`: -1 (the context length) or at least 1 (0 is refused
# by the engine's check, which names it), None: the whole prompt
TruncateTokens = Annotated[int, Field(ge=-1, lt=2**63)] | None


class SamplingFields(OpenAIModel):
    """Sampling fields shared by chat and completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = None
    # OpenAI's: token id (a string, as JSON keys are) -> a bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, lt=2**31)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    return_token_ids: bool = False  # vLLM: each streamed choice carries its `token_ids`
    kv_transfer_params: KVTransferParams | None = None  # P/D hand-off (vLLM's)
    # vLLM's: each prompt token's logprob and this many likeliest at its position, in the
    # response's `prompt_logprobs` (not with stream, as in vLLM)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's: a reasoning model thinks at most this many tokens, then its `</think>` is
    # written for it (a worker with --reasoning-parser; -1: no limit)
    thinking_token_budget: int | None = Field(default=None, ge=-1, lt=2**31)
    # vLLM's: the prompt cut to its last this many tokens (-1: the context length)
    truncate_prompt_tokens: TruncateTokens = None

    def check_stream_options(self) -> None:
        """`stream_options` only with `stream: true` (OpenAI's API and vLLM refuse them
        otherwise; an empty object asks for nothing)."""
        if self.stream_options is not None and self.stream_options.model_fields_set \
                and not self.stream:
            raise InvalidRequestError("The 'stream_options' parameter is only allowed when "
                                      "'stream' is enabled.", param="stream_options")

    def check_prompt_logprobs(self) -> None:
        """vLLM's rule: prompt logprobs come with the whole response, not in a stream."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError("prompt_logprobs are not available when stream is true",
                                      param="prompt_logprobs")

    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` by integer token id; a key that is not one is a 400 naming it."""
        if not self.logit_bias:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdecimal():
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}",
                                          param="logit_bias")
            bias[int(key)] = value
        return bias

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def check_continue(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: continuing the final message and opening a new one exclude each other
    (a 400 naming continue_final_message)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("Cannot set both `continue_final_message` and "
                                  "`add_generation_prompt` to True.",
                                  param="continue_final_message")


class Prediction(OpenAIModel):
    """OpenAI's predicted outputs: text the answer is expected to repeat much of (a file
    being edited), drafted by speculative decoding; the answer is the same without it."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        return content_text(self.content, "prediction.content")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last message (a prefill)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    prediction: Prediction | None = None  # OpenAI's predicted outputs

    def check_continue(self) -> None:
        check_continue(self.continue_final_message, self.add_generation_prompt)

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """The tool choice after OpenAI's defaults; a 400 for a choice without tools or
        naming a tool that is not in `tools`."""
        choice = self.tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise InvalidRequestError("tool_choice requires tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or []}
            if choice.function.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.function.name!r}, which is not one of the "
                    f"tools ({', '.join(sorted(names))})", param="tool_choice")
        return choice

    def check_tool_turns(self) -> None:
        """OpenAI's rule: each `tool` message answers a call of the assistant message that
        its run of tool messages follows (a 400 naming it else). Not for translated
        Anthropic requests: `protocol.anthropic` checks their turns by Anthropic's rules."""
        calls: set[str] | None = None  # the ids the current run of tool messages may answer
        for i, m in enumerate(self.messages):
            if m.role != "tool":
                calls = {c.id for c in m.tool_calls or ()} if m.tool_calls else None
            elif m.tool_call_id is None:
                continue  # the template's check names the missing field
            elif calls is None:
                raise InvalidRequestError("messages with role 'tool' must be a response to a "
                                          "preceding message with 'tool_calls'",
                                          param=f"messages.{i}.role")
            elif m.tool_call_id not in calls:
                raise InvalidRequestError(
                    f"tool_call_id {m.tool_call_id!r} answers none of the preceding "
                    f"assistant message's tool_calls ({', '.join(sorted(calls))})",
                    param=f"messages.{i}.tool_call_id")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true",
                                          param="top_logprobs")
            return None
        return self.top_logprobs or 0


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: either `prompt` (completion) or `messages` (chat, with the
    `tools` the chat template renders, as a chat request's prompt has them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on an embeddings request's list of inputs


class PoolingFields(OpenAIModel):
    """vLLM's fields on every pooling request (its PoolingParams, and `priority`)."""

    model: str | None = None
    user: str | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    # the prompt (each text, or a scored pair) cut to its last this many tokens
    truncate_prompt_tokens: TruncateTokens = None
    # the pooler's activation (an embedding's normalization, a classifier's softmax or
    # sigmoids); None: the model's default
    use_activation: bool | None = None

    def wants_activation(self, older: str) -> bool | None:
        """`use_activation`, or its older name `older` (vLLM's `normalize` on embeddings,
        `activation` on scoring); the two disagreeing is a 400 naming the older."""
        old = getattr(self, older)
        if old is not None and self.use_activation is not None \
                and old != self.use_activation:
            raise InvalidRequestError(f"{older} is use_activation's older name, and the two "
                                      "disagree", param=older)
        return self.use_activation if self.use_activation is not None else old


class PoolingInputs(PoolingFields):
    """What an embeddings or classify request reads: `input` (one text or list of token
    ids, or a list of them), or vLLM's chat form, `messages` (one conversation, through
    the chat template as a chat request's; by default without the assistant's opening,
    `add_generation_prompt`, nor the tokenizer's special tokens, `add_special_tokens`)."""

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for `input`, False for `messages`
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def inputs(self) -> list[str | list[int]]:
        """Each `input`, in order; [] for the chat form (`messages`: the worker templates
        it). A 400 naming `input` for none, too many, or both forms, and naming a chat
        field given with `input`."""
        if self.input is not None and self.messages is not None:
            raise InvalidRequestError("give either input or messages (vLLM's chat form), "
                                      "not both", param="input")
        if self.messages is not None:
            if not self.messages:
                raise InvalidRequestError("messages must not be empty", param="messages")
            return []
        if self.input is None:
            raise InvalidRequestError("input is required (or messages, vLLM's chat form)",
                                      param="input")
        chat_only = sorted(self.model_fields_set & {"add_generation_prompt",
                                                     "continue_final_message",
                                                     "chat_template_kwargs"})
        if chat_only:
            raise InvalidRequestError(f"{chat_only[0]} applies to messages, not input",
                                      param=chat_only[0])
        return listed_inputs(self.input)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None and self.input is None

    def special_tokens(self) -> bool:
        """Whether the tokenizer adds its special tokens (vLLM's defaults: an input's
        yes, a templated conversation's no: its template wrote them)."""
        return self.add_special_tokens if self.add_special_tokens is not None \
            else not self.is_chat


class EmbeddingRequest(PoolingInputs):
    """OpenAI's `POST /v1/embeddings`: one input (text or token ids) or a list of them,
    or vLLM's chat form (`messages`)."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's older name of use_activation


def listed_inputs(given: str | list[str] | list[int] | list[list[int]]
                  ) -> list[str | list[int]]:
    """An `input` field's items: one text, one list of ids, or a list of either (a 400
    naming `input` for none or too many)."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]  # type: ignore[list-item]  # (one text, or one list of ids)
    if not given:
        raise InvalidRequestError("input must not be empty", param="input")
    if len(given) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(f"input may hold at most {MAX_EMBEDDING_INPUTS} items, "
                                  f"got {len(given)}", param="input")
    return list(given)  # type: ignore[arg-type]


class ClassificationRequest(PoolingInputs):
    """vLLM's `POST /classify` (also `/v1/classify` here) for a classification model: one
    input (text or token ids) or a list of them, or vLLM's chat form (`messages`), each
    answered with its labels' scores."""

    activation: bool | None = None  # vLLM's older name of use_activation


class PoolingRequest(PoolingInputs):
    """vLLM's `POST /pooling`: each input's (or the conversation's) pooled data as `task`
    asks: `embed`, `classify`, or one row a prompt token, `token_embed`,
    `token_classify`; None: the model's (classify for a classifier, else embed)."""

    task: Literal["embed", "classify", "token_embed", "token_classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"


class ScoreRequest(PoolingFields):
    """vLLM's `POST /v1/score` for an embedding model: `text_1` against `text_2`, one
    against many (a string, or a list of one) or pairwise (lists of one length); each
    score the cosine of the two texts' embeddings."""

    text_1: str | list[str]
    text_2: str | list[str]
    activation: bool | None = None  # vLLM's older name of use_activation

    def pairs(self) -> tuple[list[str], list[str], list[tuple[int, int]]]:
        """The texts of each side and the (text_1, text_2) index of each score."""
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        for name, side in (("text_1", left), ("text_2", right)):
            if not side:
                raise InvalidRequestError(f"{name} must not be empty", param=name)
        if len(left) == 1:
            return left, right, [(0, j) for j in range(len(right))]
        if len(left) != len(right):
            raise InvalidRequestError(f"text_1 holds {len(left)} texts and text_2 "
                                      f"{len(right)}: give one text_1, or as many as text_2",
                                      param="text_2")
        return left, right, [(i, i) for i in range(len(left))]


class RerankRequest(PoolingFields):
    """The Jina / Cohere rerank API as vLLM serves it (`POST /v1/rerank`): `documents`
    ordered by the cosine of their embedding with the `query`'s, the `top_n` best."""

    activation: bool | None = None  # vLLM's older name of use_activation
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True

    def check(self) -> None:
        if not self.documents:
            raise InvalidRequestError("documents must not be empty", param="documents")


# --------------------------------------------------------------------------- responses


def now() -> int:
    return int(time.time())


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(ResponseModel):
    name: str
    arguments: str


class ToolCallOut(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut



def reasoning_of(message: Mapping[str, Any]) -> str | None:
    """A chat message's (or a streamed delta's) thinking: vLLM's `reasoning`, or the
    earlier name `reasoning_content`, which other OpenAI-style upstreams (DeepSeek's
    API) send; None without."""
    return message.get("reasoning") or message.get("reasoning_content") or None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class _WithoutNulls(ResponseModel):
    """Serialized without its None fields: OpenAI's streamed tool-call pieces leave out
    what they do not carry, and its SDK's stream helper copies a `"type": null` over the
    first piece's `"function"` (and then fails)."""

    @model_serializer(mode="wrap")
    def _drop_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A streamed piece of a tool call: the first carries id, type and the name (with
    `arguments: ""`), the later ones only argument text, all under the same index."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "sluice"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None
    # sluice: a LoRA adapter's content hash, the key of its KV blocks (the router's
    # prefix index hashes an adapter request's tokens with it, as the engine does)
    content_hash: str | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
