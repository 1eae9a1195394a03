"""Anthropic Messages API wire types, and the translation to and from OpenAI chat.

sluice serves `/v1/messages` by translating: the Anthropic request becomes an OpenAI
chat request (`to_chat_body`), the OpenAI response or stream comes back as Anthropic
(`from_chat_response`, `StreamTranslator`). Both directions work on plain dicts so
that the gateway can translate in front of any OpenAI upstream, not only sluice's
worker; the prompt half (`chat_prompt`) is also the Anthropic prompt view of
`sluice.protocol.prompt`, so the gateway counts, the router hashes and the worker
templates one translation.

    Anthropic                              OpenAI chat
    system (str | text blocks)        ->   messages[0] {"role": "system"} (if non-empty)
    user text blocks                  ->   {"role": "user", content: text joined}
    user tool_result blocks           ->   {"role": "tool", tool_call_id, content}, one
                                           each, in block order (a run of text blocks
                                           between them stays one user message);
                                           `is_error: true` prefixes "Error: "
    assistant text + tool_use blocks  ->   {"role": "assistant", content: text joined
                                           (None if empty), tool_calls: [{id, type,
                                           function: {name, arguments: JSON of input}}]}
    assistant thinking blocks         ->   left out (templates leave earlier thinking out)
    tools [{name, description,        ->   tools [{"type": "function", "function":
           input_schema, strict}]                 {name, description, parameters, strict}}]
    tool_choice auto | any |          ->   tool_choice "auto" | "required" |
                tool {name} | none             {"type": "function", "function": {name}} | "none"
    disable_parallel_tool_use: true   ->   parallel_tool_calls: false
    max_tokens / stop_sequences       ->   max_tokens / stop
    content [thinking?,               <-   message.reasoning (a worker's --reasoning-parser;
             text?, tool_use...]               with `thinking` enabled), message.content,
                                           message.tool_calls (input is the
                                           parsed arguments; {} if they are not a JSON
                                           object, which only a cut-off call can be)
    stop_reason                       <-   finish_reason "length" -> "max_tokens";
                                           "tool_calls" -> "tool_use"; "stop" +
                                           stop_reason in stop_sequences ->
                                           "stop_sequence"; otherwise "end_turn"

`is_error` has no OpenAI field; the prefix keeps it visible to the model rather than
dropping it. Tool-use ids are the worker's call ids (`call_...`), kept as they are in
both directions.

Streaming asks the upstream for usage in every chunk (vLLM's `continuous_usage_stats`)
so that `message_start` can report the input tokens. Content blocks open as their
first piece arrives (a text block on text, a `tool_use` block on a tool call's first
delta, closing the block before it) and are numbered from 0 in order, as Anthropic
does; a response with neither has one empty text block. Errors use Anthropic's shape:
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sluice.protocol.errors import InvalidRequestError, SluiceError
from sluice.protocol.openai import TOOL_NAME, content_text, function_tool, reasoning_of


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# Parameters Anthropic defines that sluice does not implement: a 400 naming them.
UNSUPPORTED_MESSAGES: tuple[str, ...] = (
    "container", "mcp_servers", "service_tier",
)


def reject_unsupported(body: dict[str, Any]) -> dict[str, Any]:
    """A 400 for the first of those set; the body without the ones left empty."""
    for name in UNSUPPORTED_MESSAGES:
        if body.get(name) not in (None, [], {}):
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
    return {k: v for k, v in body.items() if k not in UNSUPPORTED_MESSAGES}


# --------------------------------------------------------------------------- requests

# Content block types each role may send (Anthropic's rule: tool_use blocks are the
# assistant's, tool_result blocks the user's).
BLOCK_TYPES: dict[str, tuple[str, ...]] = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
THINKING_BLOCKS = ("thinking", "redacted_thinking")  # taken, and left out of the prompt


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: str
    # Accepted and honoured implicitly: sluice's prefix cache caches every prompt.
    cache_control: dict[str, Any] | None = None


def _text_blocks_only(value: Any) -> Any:
    for block in value if isinstance(value, list) else []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise ValueError(f"content block type {kind!r} is not supported (only 'text')")
    return value


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: StrictBool = False
    cache_control: dict[str, Any] | None = None

    _check = field_validator("content", mode="before")(_text_blocks_only)


class ThinkingBlock(AnthropicModel):
    """An earlier answer's thinking, sent back (the SDKs return whole turns)."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""
    cache_control: dict[str, Any] | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: dict[str, Any] | None = None


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = BLOCK_TYPES.get(info.data.get("role", ""), ("text",))
        for block in value if isinstance(value, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                raise ValueError(f"content block type {kind!r} is not supported in a "
                                 f"{info.data.get('role')} message (only "
                                 f"{', '.join(map(repr, allowed))})")
        return value


class Tool(AnthropicModel):
    """A client tool (`type` "custom" or absent); server tools (web search, code
    execution, ...) are refused naming `tools.N.type`."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # as OpenAI's: forced calls always follow the schema
    cache_control: dict[str, Any] | None = None


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is required with type 'tool' and only allowed there")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("'disable_parallel_tool_use' is not allowed with type 'none'")
        return self


class Metadata(AnthropicModel):
    user_id: str | None = None


class JsonOutputFormat(AnthropicModel):
    """Anthropic's structured outputs: the answer's text is JSON matching `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(AnthropicModel):
    """`output_config`: `format` is enforced by the structured-output engine, as the chat
    route's `response_format: json_schema` with `strict` (the schema is not added to
    the prompt, as vLLM's is not); `effort`, a reasoning model's setting, is a 400."""

    format: JsonOutputFormat | None = None
    effort: str | None = None

    @model_validator(mode="after")
    def _no_effort(self) -> OutputConfig:
        if self.effort is not None:
            raise ValueError("'effort' is not supported by this server (no reasoning model)")
        return self


class ThinkingConfig(AnthropicModel):
    """Extended thinking. Enabled: a worker with a reasoning parser answers with its
    thinking as `thinking` blocks (its model thinks whether asked or not; a model that
    does not think gives none); `budget_tokens` is checked as Anthropic checks it (at
    least 1,024, below max_tokens) and is the engine's `thinking_token_budget`: the
    thinking ends there (`</think>` written for the model)."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None

    @model_validator(mode="after")
    def _budget_iff_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < 1024):
            raise ValueError("'budget_tokens' of at least 1024 is required with type 'enabled'")
        if self.type == "disabled" and self.budget_tokens is not None:
            raise ValueError("'budget_tokens' is only allowed with type 'enabled'")
        return self


class MessagesRequest(AnthropicModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: ThinkingConfig | None = None
    # Accepted and honoured implicitly: sluice's prefix cache caches every prompt.
    cache_control: dict[str, Any] | None = None
    # sluice's extension, vLLM's field on the OpenAI routes: each streamed event carries
    # the output token ids it says (`token_ids`, a `ping` for ids with nothing to say),
    # so the router can resume the stream on another worker (router/migrate.py).
    return_token_ids: StrictBool = False

    _check = field_validator("system", mode="before")(_text_blocks_only)

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        if self.thinking is not None and (self.thinking.budget_tokens or 0) >= self.max_tokens:
            raise InvalidRequestError("max_tokens must be greater than thinking.budget_tokens",
                                      param="max_tokens")
        return self

    @property
    def thinks(self) -> bool:
        return self.thinking is not None and self.thinking.type == "enabled"


class CountTokensRequest(AnthropicModel):
    """`POST /v1/messages/count_tokens` (Anthropic's, and vLLM's): the prompt half of a
    Messages request; the answer is `{"input_tokens": N}`, what a Messages request with
    the same prompt reports as `usage.input_tokens`."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None  # checked; it adds no prompt tokens here
    thinking: ThinkingConfig | None = None  # checked; it adds no prompt tokens here
    cache_control: dict[str, Any] | None = None

    _check = field_validator("system", mode="before")(_text_blocks_only)


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- translation


def chat_prompt(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prompt half of the OpenAI chat request for an Anthropic one: `messages`, and
    `tools` when there are any (module docstring). Reads a raw body (the gateway's and
    the router's prompt view) or a validated request's `model_dump()` (the worker) alike;
    a shape it cannot translate is a 400 naming the Anthropic parameter."""
    system = body.get("system")
    text = "" if system is None else _text(system, "system")
    prompt: dict[str, Any] = {"messages": ([{"role": "system", "content": text}] if text else [])
                              + _messages(body.get("messages"))}
    if tools := _tools(body.get("tools")):
        prompt["tools"] = tools
    return prompt


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, Mapping) else type(block).__name__


def _text(content: Any, param: str) -> str:
    """A string, or text blocks joined without separator."""
    return content_text(content, param, noun="text blocks")


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise InvalidRequestError("'messages' must be a list", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in ("user", "assistant"):
            raise InvalidRequestError("a message's role must be 'user' or 'assistant'",
                                      param=f"messages.{i}.role")
        content, param = m.get("content"), f"messages.{i}.content"
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise InvalidRequestError("content must be a string or a list of content blocks",
                                      param=param)
        else:
            out += _assistant_turn(content, param) if role == "assistant" else \
                _user_turn(content, param)
    return out


def _refuse_block(block: Any, role: str, param: str) -> InvalidRequestError:
    allowed = ", ".join(map(repr, BLOCK_TYPES[role]))
    return InvalidRequestError(f"content block type {_kind(block)!r} is not supported in a "
                               f"{role} message (only {allowed})", param=param)


def _user_turn(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """Tool results as `tool` messages, each run of text blocks as one user message."""
    out: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = _kind(block)
        if kind == "tool_result":
            out.append(_tool_message(block, f"{param}.{j}"))
        elif kind == "text" and isinstance(block.get("text"), str):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block["text"]
            else:
                out.append({"role": "user", "content": block["text"]})
        else:
            raise _refuse_block(block, "user", param)
    return out or [{"role": "user", "content": ""}]


def _tool_message(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise InvalidRequestError("a tool_result block needs a string 'tool_use_id'",
                                  param=f"{param}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else _text(content, f"{param}.content")
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": use_id, "content": text}


def _assistant_turn(blocks: list[Any], param: str) -> list[dict[str, Any]]:
    """One assistant message: its text blocks joined, its tool_use blocks as tool calls."""
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = _kind(block)
        if kind == "tool_use":
            calls.append(_tool_call(block, f"{param}.{j}"))
        elif kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind in THINKING_BLOCKS:
            continue
        else:
            raise _refuse_block(block, "assistant", param)
    message: dict[str, Any] = {"role": "assistant",
                               "content": "".join(text) if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tool_call(block: Mapping[str, Any], param: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str):
            raise InvalidRequestError(f"a tool_use block needs a string '{name}'",
                                      param=f"{param}.{name}")
    if not isinstance(block.get("input"), Mapping):
        raise InvalidRequestError("a tool_use block's 'input' must be an object",
                                  param=f"{param}.input")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"],
                         "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    return [_tool(t, f"tools.{i}") for i, t in enumerate(raw)]


def _tool(tool: Any, param: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise InvalidRequestError("a tool must be an object", param=param)
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequestError(f"tool type {tool.get('type')!r} is not supported (only "
                                  "client tools, type 'custom')", param=f"{param}.type")
    if not isinstance(tool.get("name"), str):
        raise InvalidRequestError("a tool needs a string 'name'", param=f"{param}.name")
    if not isinstance(tool.get("input_schema"), Mapping):
        raise InvalidRequestError("a tool needs an 'input_schema' object",
                                  param=f"{param}.input_schema")
    return function_tool(tool["name"], tool.get("description"), tool["input_schema"],
                         tool.get("strict"))


_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_tool_choice(choice: ToolChoice | None) -> dict[str, Any]:
    """OpenAI's `tool_choice` (and `parallel_tool_calls`) for Anthropic's `tool_choice`."""
    if choice is None:
        return {}
    fields: dict[str, Any] = {"tool_choice": _TOOL_CHOICES.get(choice.type) or {
        "type": "function", "function": {"name": choice.name}}}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


_TOOL_FIELDS = {"parameters": "input_schema", "name": "name", "description": "description"}


def anthropic_param(param: str | None) -> str | None:
    """A parameter named by the OpenAI path (which serves /v1/messages after translation)
    as the Anthropic client wrote it: `tools.N.function.parameters` is `tools.N.input_schema`."""
    if param == "thinking_token_budget":
        return "thinking.budget_tokens"
    parts = (param or "").split(".")
    if len(parts) >= 4 and parts[0] == "tools" and parts[2] == "function" \
            and parts[3] in _TOOL_FIELDS:
        return ".".join([*parts[:2], _TOOL_FIELDS[parts[3]], *parts[4:]])
    return param


def check_conversation(req: MessagesRequest | CountTokensRequest) -> None:
    """Anthropic's rules for the turns themselves, as its API refuses them (400): every
    message has content but a final assistant one (a prefill), and each `tool_result`
    answers a `tool_use` of the assistant message just before it."""
    last = len(req.messages) - 1
    for i, m in enumerate(req.messages):
        if not m.content and not (i == last and m.role == "assistant"):
            raise InvalidRequestError("all messages must have non-empty content except for "
                                      "the optional final assistant message",
                                      param=f"messages.{i}.content")
        asked = _tool_use_ids(req.messages[i - 1]) if i else set()
        for j, b in enumerate(m.content if isinstance(m.content, list) else []):
            if isinstance(b, ToolResultBlock) and b.tool_use_id not in asked:
                raise InvalidRequestError(
                    f"unexpected tool_use_id {b.tool_use_id!r} in a tool_result block: each "
                    "tool_result must answer a tool_use block of the previous message",
                    param=f"messages.{i}.content.{j}.tool_use_id")


def _tool_use_ids(m: Message) -> set[str]:
    blocks = m.content if m.role == "assistant" and isinstance(m.content, list) else []
    return {b.id for b in blocks if isinstance(b, ToolUseBlock)}


def prompt_body(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The prompt half of the OpenAI chat request: the model, messages and tools, and for
    a prefill the final assistant text continued instead of the answer's turn opened;
    what the worker templates for `/v1/messages`, and the `/tokenize` request (vLLM's,
    with messages) that `/v1/messages/count_tokens` counts.
    Turns that `check_conversation` refuses are a 400."""
    check_conversation(req)
    prompt: dict[str, Any] = {"model": req.model, **chat_prompt(req.model_dump())}
    if is_prefill(prompt["messages"]):  # the answer continues the final assistant text
        prompt.update(add_generation_prompt=False, continue_final_message=True)
    return prompt


def to_chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The OpenAI chat request equivalent to an Anthropic Messages request: its
    `prompt_body`, then the sampling fields."""
    body = {**prompt_body(req), "max_tokens": req.max_tokens,
            **chat_tool_choice(req.tool_choice)}
    optional = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
                "stop": req.stop_sequences or None,
                "user": req.metadata.user_id if req.metadata else None}
    body.update({k: v for k, v in optional.items() if v is not None})
    if req.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if req.return_token_ids:
        body["return_token_ids"] = True
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.json_schema, "strict": True}}
    return body


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """Whether translated messages end in an assistant turn with text (Anthropic's
    prefill: the response continues it; an empty one asks for nothing)."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and isinstance(last.get("content"), str) \
        and bool(last["content"].strip()) and not last.get("tool_calls")


def stop_reason(finish_reason: str | None, matched: Any,
                stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from OpenAI's finish_reason and vLLM's stop_reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason is None:
        return None, None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's `arguments` text as Anthropic's `input` object ({} unless it is
    one: a call cut off by max_tokens)."""
    try:
        value = json.loads(arguments or "{}")
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: Mapping[str, Any]) -> dict[str, Any]:
    """Anthropic's `tool_use` block for an OpenAI tool call."""
    function = call.get("function") or {}
    return {"type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or "",
            "input": tool_input(function.get("arguments"))}


def from_chat_response(resp: dict[str, Any], req: MessagesRequest) -> MessagesResponse:
    """The Anthropic response for an OpenAI chat completion (first choice): its text
    block (left out when empty and there are tool calls), then a tool_use block per call."""
    choice = resp["choices"][0]
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                   req.stop_sequences)
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    reasoning = reasoning_of(message)
    content = [thinking_block(reasoning)] if req.thinks and reasoning else []
    content += [{"type": "text", "text": text}] if text or not calls else []
    usage = resp.get("usage") or {}
    return MessagesResponse(
        id=new_message_id(), content=content + [tool_use_block(c) for c in calls],
        model=req.model, stop_reason=reason, stop_sequence=sequence,
        usage=Usage(input_tokens=usage.get("prompt_tokens", 0),
                    output_tokens=usage.get("completion_tokens", 0)),
    )


def thinking_block(text: str) -> dict[str, Any]:
    """A thinking block; its `signature` is empty (sluice signs nothing: a thinking
    block sent back is left out of the prompt whatever it says)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


Event = tuple[str, dict[str, Any]]


class StreamTranslator:
    """Turns a stream of OpenAI chat chunks (dicts) into Anthropic stream events.

    Feed every chunk to `feed`, then call `finish` once; both return the events to send
    in order. Holds the running usage, the stop reason and the open content block (one
    at a time: OpenAI streams tool calls one after another); not thread-safe.
    """

    def __init__(self, req: MessagesRequest) -> None:
        self.req = req
        self.id = new_message_id()
        self.started = False
        self.usage = Usage()
        self.reason: str | None = None
        self.sequence: str | None = None
        self.blocks = 0  # content blocks opened so far: the next one's index
        self.open: str | None = None  # the type of the block being streamed, if any
        self.calls: dict[int, int] = {}  # OpenAI tool-call index -> content block index

    def _start(self) -> list[Event]:
        self.started = True
        message = MessagesResponse(id=self.id, content=[], model=self.req.model,
                                   usage=Usage(input_tokens=self.usage.input_tokens))
        return [("message_start", {"type": "message_start", "message": message.model_dump()}),
                ("ping", {"type": "ping"})]

    def start(self) -> list[Event]:
        """Nothing: `message_start` waits for the first chunk, whose usage it reports."""
        return []

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        if chunk.get("usage"):
            self.usage = Usage(input_tokens=chunk["usage"].get("prompt_tokens", 0),
                               output_tokens=chunk["usage"].get("completion_tokens", 0))
        events = [] if self.started else self._start()
        ids: list[int] = []
        for choice in chunk.get("choices") or []:
            events += self._said(choice.get("delta") or {})
            ids += choice.get("token_ids") or ()
            if choice.get("finish_reason"):
                self.reason, self.sequence = stop_reason(
                    choice["finish_reason"], choice.get("stop_reason"), self.req.stop_sequences)
        if ids:  # `return_token_ids`: on the chunk's last event, or a ping of their own
            if events:
                events[-1][1]["token_ids"] = ids
            else:
                events.append(("ping", {"type": "ping", "token_ids": ids}))
        return events

    def replay(self, delta: dict[str, Any]) -> None:
        """A resumed stream (router/migrate.py): take the state the failed worker's events
        left (started, the blocks opened) from what its output said, sending nothing."""
        self.started = True
        self._said(delta)

    def _said(self, delta: dict[str, Any]) -> list[Event]:
        reasoning = reasoning_of(delta) if self.req.thinks else None
        events = self._thinking(reasoning) if reasoning else []
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._tool_call(call)
        return events

    def _open(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.open, self.blocks = block["type"], self.blocks + 1
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": self.blocks - 1,
                                                  "content_block": block})]

    def _close(self) -> list[Event]:
        if self.open is None:
            return []
        signed = [self._delta({"type": "signature_delta", "signature": ""})] \
            if self.open == "thinking" else []  # (as Anthropic ends a thinking block)
        self.open = None
        return signed + [("content_block_stop", {"type": "content_block_stop",
                                                 "index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1,
                                        "delta": delta})

    def _text(self, text: str) -> list[Event]:
        events = [] if self.open == "text" else self._open({"type": "text", "text": ""})
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _thinking(self, text: str) -> list[Event]:
        events = [] if self.open == "thinking" else self._open(thinking_block(""))
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _tool_call(self, call: dict[str, Any]) -> list[Event]:
        """A call's first delta (it names the function) opens its tool_use block; its
        argument pieces are input_json_delta events of that block."""
        function = call.get("function") or {}
        events: list[Event] = []
        if function.get("name") is not None:
            events = self._open({"type": "tool_use", "id": call.get("id") or "",
                                 "name": function["name"], "input": {}})
            self.calls[call.get("index", 0)] = self.blocks - 1
        streaming = self.open == "tool_use" and self.calls.get(call.get("index", 0)) == \
            self.blocks - 1
        if function.get("arguments") and streaming:
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": function["arguments"]}))
        return events

    def finish(self) -> list[Event]:
        events = [] if self.started else self._start()
        if self.blocks == 0 or (self.blocks == 1 and self.open == "thinking"):  # nothing
            events += self._open({"type": "text", "text": ""})  # said: an empty text block
        return events + self._close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": self.reason,
                                         "stop_sequence": self.sequence},
                               "usage": {"output_tokens": self.usage.output_tokens}}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def failed(self, exc: SluiceError) -> list[Event]:
        """A stream that broke: Anthropic's `error` event."""
        return [("error", error_body(exc))]


def sse(event: Event) -> str:
    """One Anthropic server-sent event."""
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


# --------------------------------------------------------------------------- errors

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error", 529: "overloaded_error",
}


def error_body(exc: SluiceError) -> dict[str, Any]:
    """Anthropic's error JSON for a sluice error. Its shape has no `param`, so the field
    leads the message where the message does not name it (Anthropic's own style:
    `tools.0.input_schema: ...`)."""
    kind = ERROR_TYPES.get(exc.status_code, "api_error")
    message = exc.message
    if exc.param and exc.param not in message:
        message = f"{exc.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}
