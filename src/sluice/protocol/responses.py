"""OpenAI's Responses API (`POST /v1/responses`), served by translating to and from chat.

As `/v1/messages` (protocol/anthropic.py), the request becomes an OpenAI chat request
(`to_chat_body`) and the chat response or stream comes back as a Response
(`from_chat_response`, `StreamTranslator`); both directions work on plain dicts, and
the prompt half (`chat_prompt`) is the Responses prompt view of `sluice.protocol.prompt`,
so the gateway counts, the router hashes and the worker templates one translation.

    Responses                                   OpenAI chat
    instructions                           ->   messages[0] {"role": "system"} (if given)
    input "text"                           ->   {"role": "user", "content": text}
    input message items {role, content}    ->   {"role", "content": text parts joined};
      (type "message" or absent; content a       "developer" is "system"
      string or input_text / output_text /
      refusal parts)
    function_call items {call_id, name,    ->   the assistant message's tool_calls (a run
      arguments}                                 of them after an assistant message joins it)
    function_call_output {call_id, output} ->   {"role": "tool", "tool_call_id", "content"}
    reasoning items (an earlier answer's)  ->   left out, as templates leave old thinking out
    tools [{type "function", name,         ->   tools [{"type": "function", "function":
           description, parameters, strict}]           {name, description, parameters, strict}}]
    tool_choice auto | none | required |   ->   tool_choice, the same; a named function as
                {type "function", name}          {"type": "function", "function": {name}}
    max_output_tokens                      ->   max_tokens
    text.format json_schema | json_object  ->   response_format
    output [reasoning {reasoning_text}?,   <-   message.reasoning (--reasoning-parser),
            message {output_text}?,              message.content, message.tool_calls
            function_call...]
    status completed | incomplete          <-   finish_reason ("length": incomplete,
      (incomplete_details.reason                 reason "max_output_tokens")
       "max_output_tokens")
    usage {input_tokens, output_tokens}    <-   usage {prompt_tokens, completion_tokens}

A worker (and a router) keeps no responses: `store` may only be false (or absent; the
Response says `"store": false`; retrieving, deleting or cancelling one is a 404 saying
so), and what needs a stored response or conversation (`previous_response_id`,
`conversation`, `background`) is a 400 naming it. The gateway in front (`sluice serve`,
`sluice gateway`) keeps them: it expands `previous_response_id` into the input, sends
`store` false, stores the final Response and serves the stored-response routes
(gateway/responses.py). Also a 400 naming it:
hosted tools, images and files, and the `reasoning` settings. The stream is OpenAI's event
sequence (`response.created`, `response.in_progress`, per output item
`response.output_item.added`, its deltas (`response.reasoning_text.delta` for thinking)
and `...done` events, then
`response.completed` or `response.incomplete` with the usage), each event with its
`sequence_number`; there is no `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from sluice.protocol.errors import InvalidRequestError, NotFoundError, SluiceError
from sluice.protocol.openai import (
    TOOL_NAME,
    Acceptable,
    KVTransferParams,
    content_text,
    function_tool,
    reasoning_of,
)

PATH = "/v1/responses"

# Parameters of OpenAI's Responses API that sluice does not implement, each with what
# asks for nothing (`reject_unsupported(body, UNSUPPORTED)` of protocol/openai.py: a
# 400 naming the first set to more; its INSTEAD says what to do for the stored ones).
UNSUPPORTED: dict[str, Acceptable] = {
    "previous_response_id": lambda v: v is None,
    "conversation": lambda v: v is None,
    "background": lambda v: v is None or v is False,
    "include": lambda v: v is None or v == [],
    "reasoning": lambda v: v is None or v == {},
    "prompt": lambda v: v is None,
    "top_logprobs": lambda v: v is None or type(v) is int and v == 0,
    "max_tool_calls": lambda v: v is None,
    "service_tier": lambda v: v is None or v in ("auto", "default"),
    "truncation": lambda v: v is None or v == "disabled",
    "stream_options": lambda v: v is None or v == {},
}
INPUT_TOKENS_PATH = PATH + "/input_tokens"  # OpenAI's count of a request's input tokens
# What OpenAI serves on a stored response (retrieve, delete, cancel, its input items):
# here a 404 that says why, since no response is ever stored.
STORED_PATHS = (PATH + "/{response_id}", PATH + "/{response_id}/cancel",
                PATH + "/{response_id}/input_items")


def not_stored(response_id: str) -> NotFoundError:
    return NotFoundError(f"No response with id {response_id!r}: this server stores no "
                         "responses (every response is store: false; the sluice gateway "
                         "stores them)", param="response_id", code="response_not_found")


async def stored_response(request: Any) -> Any:
    """The endpoint of `STORED_PATHS` on a worker or router (a Starlette request): a
    404 saying why, since neither keeps responses."""
    raise not_stored(request.path_params["response_id"])


class ResponsesModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(ResponsesModel):
    """A Responses function tool: chat's `FunctionDefinition` with its fields at the top
    (written out, not inherited: `type` is checked first, so another tool type is a 400
    naming `tools.N.type`)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(ResponsesModel):
    type: Literal["function"]
    name: str


class TextFormat(ResponsesModel):
    """`text.format`: plain text, a JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextConfig(ResponsesModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a non-reasoning model has


class InputTokensRequest(ResponsesModel):
    """The prompt half of a Responses request; alone, `POST /v1/responses/input_tokens`
    (OpenAI's), answered `{"object": "response.input_tokens", "input_tokens": N}`: what a
    Responses request with the same prompt reports as `usage.input_tokens`."""

    model: str | None = None  # the served model, as on chat (the router requires one)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None  # (no prompt tokens: checked, for a count)
    text: TextConfig | None = None


class ResponsesRequest(InputTokensRequest):
    """A Responses request: its prompt half (`InputTokensRequest`) and how to answer."""

    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool | None = None  # false only: nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Accepted and honoured implicitly: sluice's prefix cache caches every prompt.
    prompt_cache_key: str | None = None
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)  # vLLM's extension, as on chat
    # P/D hand-off (vLLM's, as on chat; the router's, never a client's: the gateway
    # refuses it): a prefill's answer carries the decode side's in its Response
    kv_transfer_params: KVTransferParams | None = None
    # vLLM's chat field, here too (the router sets it to migrate a stream): the output
    # token ids ride on the stream's events (`token_ids`)
    return_token_ids: StrictBool = False

    @field_validator("store")
    @classmethod
    def _not_stored(cls, value: bool | None) -> bool | None:
        if value:  # its response id would be one that nothing can find
            raise ValueError("'store': true is not supported: this server keeps no "
                             "responses (the sluice gateway does); send 'store': false")
        return value


# --------------------------------------------------------------------------- requests


def chat_prompt(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prompt half of the OpenAI chat request for a Responses request: `messages`,
    and `tools` when there are any (module docstring). Reads a raw body (the gateway's
    and the router's prompt view; the worker's too), so all three see one translation;
    a shape it cannot translate is a 400 naming the Responses parameter."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("'instructions' must be a string", param="instructions")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list):
        messages += _items(raw)
    else:
        raise InvalidRequestError("'input' must be a string or a list of input items",
                                  param="input")
    if not messages:
        raise InvalidRequestError("'input' has no items", param="input")
    prompt: dict[str, Any] = {"messages": messages}
    if tools := _tools(body.get("tools")):
        prompt["tools"] = tools
    return prompt


_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# a content part's type -> the field its text is in
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


def _items(items: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, Mapping):
            raise InvalidRequestError("an input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise InvalidRequestError("a message's role must be 'user', 'assistant', "
                                          "'system' or 'developer'", param=f"{param}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = _call(item, param)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                if out[-1]["content"] == "":
                    out[-1]["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_tool_message(item, param))
        elif kind == "reasoning":
            continue  # an earlier answer's thinking, sent back: templates leave it out
        else:
            raise InvalidRequestError(
                f"input item type {kind!r} is not supported (only 'message', "
                "'function_call', 'function_call_output' and 'reasoning')",
                param=f"{param}.type")
    return out


def _text(content: Any, param: str) -> str:
    """A string, or text parts (input and output text, a refusal) joined without
    separator."""
    return content_text(content, param, _TEXT_PARTS, "text content parts", name_part=True)


def _call(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str):
            raise InvalidRequestError(f"a function_call item needs a string '{name}'",
                                      param=f"{param}.{name}")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _tool_message(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(item.get("call_id"), str):
        raise InvalidRequestError("a function_call_output item needs a string 'call_id'",
                                  param=f"{param}.call_id")
    output = item.get("output")
    if not isinstance(output, str):
        output = _text(output, f"{param}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(raw):
        param = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError("a tool must be an object", param=param)
        if tool.get("type") != "function":
            raise InvalidRequestError(f"tool type {tool.get('type')!r} is not supported (only "
                                      "'function': this server runs no hosted tools)",
                                      param=f"{param}.type")
        if not isinstance(tool.get("name"), str):
            raise InvalidRequestError("a function tool needs a string 'name'",
                                      param=f"{param}.name")
        out.append(function_tool(tool["name"], tool.get("description"),
                                 tool.get("parameters") or {"type": "object", "properties": {}},
                                 tool.get("strict")))
    return out


def prompt_body(req: InputTokensRequest, body: Mapping[str, Any]) -> dict[str, Any]:
    """The prompt half of the OpenAI chat request (`body`: the JSON `req` validated): the
    model where it names one, the messages and tools; what `/v1/responses/input_tokens`
    counts (as vLLM's `/tokenize` with messages)."""
    return {"model": req.model, **chat_prompt(body)} if req.model else chat_prompt(body)


def to_chat_body(req: ResponsesRequest, body: Mapping[str, Any]) -> dict[str, Any]:
    """The OpenAI chat request equivalent to a Responses request (`body`: its JSON, which
    `req` validated): its `prompt_body`, then the sampling fields."""
    chat = prompt_body(req, body)
    optional = {"max_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                "user": req.user or req.safety_identifier}
    chat.update({k: v for k, v in optional.items() if v is not None})
    if isinstance(req.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    form = req.text.format if req.text is not None else None
    if form is not None and form.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        if form.schema_ is None:
            raise InvalidRequestError("a json_schema format needs a 'schema'",
                                      param="text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": form.name or "output", "schema": form.schema_,
            **({"strict": form.strict} if form.strict is not None else {})}}
    if req.priority:
        chat["priority"] = req.priority
    if req.kv_transfer_params is not None:
        chat["kv_transfer_params"] = req.kv_transfer_params.model_dump(exclude_none=True)
    if req.return_token_ids:
        chat["return_token_ids"] = True
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_param(param: str | None) -> str | None:
    """A parameter named by the chat path (which serves /v1/responses after translation)
    as the Responses client wrote it: `max_tokens` is `max_output_tokens`,
    `tools.N.function.parameters` is `tools.N.parameters`."""
    parts = (param or "").split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":
        return ".".join([*parts[:2], *parts[3:]])
    if parts[0] == "messages":  # a turn of the translation: the input as a whole
        return "input"
    if parts[0] in _CHAT_PARAMS:
        return ".".join([_CHAT_PARAMS[parts[0]], *parts[1:]])
    return param


# --------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (u.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status == "completed" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking (the worker's `--reasoning-parser`), in the clear."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [reasoning_part(text)] if status == "completed" else []}


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response(req: ResponsesRequest, response_id: str, created_at: int, *,
             status: str = "completed", output: list[dict[str, Any]] | None = None,
             chat_usage: Mapping[str, Any] | None = None,
             model: str | None = None) -> dict[str, Any]:
    """The Response object; `status` in_progress (a stream's first events), completed
    or incomplete (the answer reached max_output_tokens). `model`: the name that served
    it (the request's, or the default model's where it named none)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    text = req.text.model_dump(exclude_none=True, by_alias=True) \
        if req.text is not None and req.text.format is not None else {"format": {"type": "text"}}
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": model or req.model, "output": output or [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": text,
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunction) else
        choice or "auto",
        "tools": tools, "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": "disabled", "user": req.user, "metadata": req.metadata or {},
        "usage": usage(chat_usage) if status != "in_progress" else None,
    }


def from_chat_response(resp: Mapping[str, Any], req: ResponsesRequest) -> dict[str, Any]:
    """The Response for an OpenAI chat completion (its first choice): a reasoning item
    with the thinking (a worker with a reasoning parser), a message item with the text
    (left out when empty and there are calls), then a function_call item per tool call."""
    choice = resp["choices"][0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    reasoning = reasoning_of(message)
    output = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
    output += [message_item(new_id("msg"), text)] if text or not calls else []
    for call in calls:
        function = call.get("function") or {}
        output.append(call_item(new_id("fc"), call.get("id") or "", function.get("name") or "",
                                function.get("arguments") or ""))
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    out = response(req, new_id("resp"), int(resp.get("created") or time.time()),
                   status=status, output=output, chat_usage=resp.get("usage"),
                   model=resp.get("model"))
    if resp.get("kv_transfer_params") is not None:  # a P/D prefill's, for the router
        out["kv_transfer_params"] = resp["kv_transfer_params"]
    return out


Event = dict[str, Any]


class StreamTranslator:
    """Turns a stream of OpenAI chat chunks (dicts) into Responses stream events.

    `start` gives the opening events, `feed` those of each chunk, `finish` the closing
    ones; each event is numbered (`sequence_number`) as it is made. Output items open
    as their first piece arrives (a reasoning item on thinking, a message on text, a
    function_call on a tool call's first delta, closing the item before it), numbered
    from 0 in order. With `return_token_ids` a chunk's token ids ride on the next event
    made (`token_ids`). A resumed stream (router/migrate.py) first `replay`s what the
    failed worker's output said: its events were sent, so none are made for it."""

    def __init__(self, req: ResponsesRequest, model: str | None = None) -> None:
        self.req = req
        self.model = model  # the served name, where the request named none
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items done, and the open one (last)
        self.open: dict[str, Any] | None = None
        self.said = ""  # the open message's or reasoning's text so far
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.chat_usage: Mapping[str, Any] | None = None
        self.finish_reason: str | None = None
        self.resumed = False
        self.ids: list[int] = []  # token ids that no event has carried yet

    def _event(self, kind: str, **fields: Any) -> Event:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _response(self, status: str) -> dict[str, Any]:
        return response(self.req, self.id, self.created_at, status=status,
                        output=[dict(item) for item in self.output], chat_usage=self.chat_usage,
                        model=self.model)

    def start(self) -> list[Event]:
        if self.resumed:
            return []
        begun = self._response("in_progress")
        return [self._event("response.created", response=begun),
                self._event("response.in_progress", response=begun)]

    def replay(self, delta: dict[str, Any]) -> None:
        """A resumed stream: take the state the failed worker's events left (the items
        opened, their text) from what its output said, making no event."""
        self.resumed = True
        self.feed({"choices": [{"delta": delta}]})

    def feed(self, chunk: Mapping[str, Any]) -> list[Event]:
        if chunk.get("usage"):
            self.chat_usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if reasoning := reasoning_of(delta):
                events += self._reasoning(reasoning)
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            self.ids += choice.get("token_ids") or ()
        return self._with_ids(events)

    def _with_ids(self, events: list[Event]) -> list[Event]:
        if self.ids and events:
            events[-1]["token_ids"], self.ids = self.ids, []
        return events

    def _index(self) -> int:
        return len(self.output) - 1

    def _open(self, item: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.open = item
        self.output.append(item)
        return events + [self._event("response.output_item.added", output_index=self._index(),
                                     item=dict(item))]

    def _open_message(self) -> list[Event]:
        item = message_item(new_id("msg"), "", status="in_progress")
        events = self._open(item)
        self.said = ""
        return events + [self._event("response.content_part.added", item_id=item["id"],
                                     output_index=self._index(), content_index=0,
                                     part=text_part(""))]

    def _text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "message":
            events = self._open_message()
        assert self.open is not None
        self.said += text
        return events + [self._event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=self._index(), content_index=0, delta=text,
                                     logprobs=[])]

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.open is None or self.open["type"] != "reasoning":
            events = self._open(reasoning_item(new_id("rs"), "", status="in_progress"))
            self.said = ""
        assert self.open is not None
        self.said += text
        return events + [self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                     output_index=self._index(), content_index=0, delta=text)]

    def _tool_call(self, call: Mapping[str, Any]) -> list[Event]:
        function = call.get("function") or {}
        index = call.get("index", 0)
        events: list[Event] = []
        if function.get("name") is not None:
            opened = call_item(new_id("fc"), call.get("id") or "", function["name"], "",
                               status="in_progress")
            events = self._open(opened)
            self.calls[index] = opened
        item = self.calls.get(index)
        if function.get("arguments") and item is not None and item is self.open:
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self._index(),
                                      delta=function["arguments"]))
        return events

    def _close(self) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = self._index(), []
        if item["type"] == "message":
            text = self.said
            item.update(status="completed", content=[text_part(text)])
            events += [self._event("response.output_text.done", item_id=item["id"],
                                   output_index=index, content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"],
                                   output_index=index, content_index=0, part=text_part(text))]
        elif item["type"] == "reasoning":
            item.update(status="completed", content=[reasoning_part(self.said)])
            events.append(self._event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=index, content_index=0, text=self.said))
        else:
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
        return events + [self._event("response.output_item.done", output_index=index,
                                     item=dict(item))]

    def finish(self) -> list[Event]:
        """The closing events: the open item's, then `response.completed` (or
        `response.incomplete` when the answer reached max_output_tokens)."""
        events: list[Event] = []
        if not any(item["type"] != "reasoning" for item in self.output):  # nothing was
            events += self._open_message()  # said: one empty message, as non-streamed
        events += self._close()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return self._with_ids(events + [self._event(f"response.{status}",
                                                    response=self._response(status))])

    def failed(self, exc: SluiceError) -> list[Event]:
        """A stream that broke: `response.failed` with the error (as OpenAI ends one)."""
        failed = self._response("failed")
        failed["error"] = {"code": exc.code or exc.error_type, "message": exc.message}
        return [self._event("response.failed", response=failed)]


# the events a whole stream ends with (its status), and the one a broken stream ends with
END_EVENTS = ("response.completed", "response.incomplete")
FAILED_EVENT = "response.failed"


def sse(event: Event) -> str:
    """One Responses server-sent event (named by its type, as OpenAI sends them)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def error_event(exc: SluiceError, number: int) -> bytes:
    """OpenAI's `error` event, numbered `number`: a Responses stream that cannot go on
    (a migration that failed, a kept stream the store stopped answering)."""
    return sse({"type": "error", "code": exc.code or exc.error_type, "message": exc.message,
                "param": exc.param, "sequence_number": number}).encode()
