"""Tool calls in a model's text: read them (whole or streamed) and force them (grammar).

A tool-call parser knows one model family's call syntax (vLLM's `--tool-call-parser`).
`hermes`, the default, reads the convention of ChatML tool templates (Hermes, Qwen,
sluice's own `chatml_tools.jinja`):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`llama3_json` (Llama 3.1-3.3 Instruct) and `mistral` (Mistral Instruct v0.3) write calls
as bare JSON objects, one state machine for both (`JsonCallsStream`):

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
    some text[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

`pythonic` (Llama 3.2 and 4's pythonic templates) writes a Python list of calls, read
whole when it closes (`PythonicStream`):

    [get_weather(city="Paris"), get_time(zone="CET")]

One streaming state machine (`ToolCallStream`) serves both response shapes: the whole
response feeds it all text at once, the stream feeds it each delta. So a streamed call
reassembles to exactly the non-streamed one (same name, byte-identical `arguments`:
the model's own JSON text, never re-serialized). Streamed deltas follow OpenAI: the
first piece of a call carries `index`, `id`, `type` and the function `name` with
`arguments: ""`; the later pieces carry argument text only.

    TEXT ──"<tool_call>"──► HEAD ──{"name": "..", "arguments": ──► ARGS ──value done──►
     ▲                       │ (other key order: the call is read whole at its end)  │
     └────────────────────────────────────"</tool_call>"◄── TAIL ◄───────────────────┘

`tool_choice` `required` or a named function is enforced, not hoped for: `constraint`
returns a structural tag (xgrammar's format, which both grammar backends read) that
admits only well-formed call blocks whose arguments follow the tool's JSON schema as
compact JSON (one call, or several when `parallel_tool_calls`), so the arguments always
parse. Compact, because free whitespace inside a forced call lets a small model emit
indentation until `max_tokens`: each backend compiles a tag's `json_schema` compact.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.sampling_params import StructuredOutputsParams
from sluice.engine.structured_output import check_constraint, check_json_schema
from sluice.protocol.errors import InvalidRequestError


@dataclass
class CallDelta:
    """A piece of one tool call: `name` set on its first piece, `arguments` text after."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream(abc.ABC):
    """Feed text deltas; get content text and call deltas. `finish` flushes the rest."""

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[CallDelta]]: ...

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[CallDelta]]: ...


class ToolParser(abc.ABC):
    """One model family's tool-call syntax (see the module docstring). `special_tokens`:
    its calls begin with a special token, so a request that may call tools is decoded
    with `skip_special_tokens` off (vLLM's parsers' `adjust_request`)."""

    special_tokens = False

    @abc.abstractmethod
    def stream(self) -> ToolCallStream: ...

    @abc.abstractmethod
    def constraint(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool,
                   backend: str = "auto") -> StructuredOutputsParams:
        """A constraint admitting only calls (of the named function if `choice` names
        one), each with arguments valid for its schema; a schema that `backend` (the
        engine's `structured_outputs_backend`) refuses is a 400 naming that tool."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """The content and the calls of a whole response (via the stream machine)."""
        content, calls = _collect(self.stream(), text)
        return (content or None) if calls else content, calls


def _collect(stream: ToolCallStream, text: str) -> tuple[str, list[ParsedCall]]:
    content, deltas = stream.feed(text)
    tail, more = stream.finish()
    calls: dict[int, ParsedCall] = {}
    for d in deltas + more:
        if d.name is not None:
            calls[d.index] = ParsedCall(d.id or new_call_id(), d.name, "")
        calls[d.index].arguments += d.arguments
    return content + tail, [calls[i] for i in sorted(calls)]


# --------------------------------------------------------------------------- hermes

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class JsonValueScanner:
    """Finds where one JSON value ends in a stream of characters (strings, escapes and
    nesting tracked); `feed` returns how many of the given characters belong to it."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = self.started = self.done = False

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self._step(ch):
                self.done = True
                return i + 1
        return len(text)

    def _step(self, ch: str) -> bool:
        """True when `ch` ends the value."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return self.depth == 0
            return False
        if ch.isspace() and not self.started:
            return False
        self.started = True
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


def stream_arguments(buffer: str, scanner: JsonValueScanner, index: int,
                     deltas: list[CallDelta]) -> str:
    """Call `index`'s arguments value as it arrives: what of `buffer` belongs to the value
    (`scanner` says where it ends; whitespace before it is not part of it) goes out as an
    arguments delta; returns the rest."""
    if not scanner.started:
        buffer = buffer.lstrip()
    used = scanner.feed(buffer)
    if used:
        deltas.append(CallDelta(index, arguments=buffer[:used]))
    return buffer[used:]


@dataclass
class HermesStream(ToolCallStream):
    state: str = "text"
    buffer: str = ""
    index: int = -1
    scanner: JsonValueScanner = field(default_factory=JsonValueScanner)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while self._advance(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """End of output: text still held is content (a partial `<tool_call>`, or a block
        whose head never parsed: cut by `max_tokens` or a stop, as vLLM's hermes parser
        returns it); a call whose arguments began was already sent as it came."""
        held = {"text": self.buffer, "head": OPEN + self.buffer}.get(self.state, "")
        self.buffer = ""
        return held, []

    def _advance(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Consume what the buffer allows in the current state; True to go again."""
        step: Any = getattr(self, f"_{self.state}")  # _text, _head, _args, _tail
        return bool(step(content, deltas))

    def _text(self, content: list[str], deltas: list[CallDelta]) -> bool:
        at = self.buffer.find(OPEN)
        if at < 0:
            keep = _partial_suffix(self.buffer, OPEN)
            out, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[
                len(self.buffer) - keep:]
            content.append(out if self.index < 0 or out.strip() else "")
            return False
        before = self.buffer[:at]
        content.append(before if self.index < 0 or before.strip() else "")
        self.buffer, self.state = self.buffer[at + len(OPEN):], "head"
        return True

    def _head(self, content: list[str], deltas: list[CallDelta]) -> bool:
        m = _HEAD.match(self.buffer)
        if m is not None:
            self.index += 1
            deltas.append(CallDelta(self.index, new_call_id(), json.loads(f'"{m.group(1)}"')))
            self.buffer, self.state, self.scanner = self.buffer[m.end():], "args", \
                JsonValueScanner()
            return True
        end = self.buffer.find(CLOSE)  # never matched the head: keys in another order
        return self._whole_call(end, content, deltas) if end >= 0 else False

    def _whole_call(self, end: int, content: list[str], deltas: list[CallDelta]) -> bool:
        """A call with its keys in another order: read it whole once it closes. A block
        that is no call (not JSON, no name) is content, as vLLM's hermes parser has it."""
        body, self.buffer, self.state = self.buffer[:end], self.buffer[end + len(CLOSE):], "text"
        call = _whole_call(body)  # its arguments as the model wrote them, never re-encoded
        if call is None:
            content.append(OPEN + body + CLOSE)
            return True
        self.index += 1
        deltas.append(CallDelta(self.index, new_call_id(), *call))
        return True

    def _args(self, content: list[str], deltas: list[CallDelta]) -> bool:
        self.buffer = stream_arguments(self.buffer, self.scanner, self.index, deltas)
        if self.scanner.done:
            self.state = "tail"
            return True
        return False

    def _tail(self, content: list[str], deltas: list[CallDelta]) -> bool:
        end = self.buffer.find(CLOSE)
        if end < 0:
            return False
        self.buffer, self.state = self.buffer[end + len(CLOSE):], "text"
        return True


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesToolParser(ToolParser):
    def stream(self) -> ToolCallStream:
        return HermesStream()

    def constraint(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool,
                   backend: str = "auto") -> StructuredOutputsParams:
        tags = [{"type": "tag",
                 "begin": f'{OPEN}\n{{"name": {json.dumps(t["function"]["name"])}, '
                          '"arguments": ',
                 "content": {"type": "json_schema", "json_schema": _checked_schema(
                     t["function"].get("parameters") or {"type": "object"},
                     f"tools.{i}.function.parameters", backend)},
                 "end": f"}}\n{CLOSE}"}
                for i, t in enumerate(tools) if choice is None or t["function"]["name"] == choice]
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
               "at_least_one": True, "stop_after_first": not parallel or choice is not None}
        return StructuredOutputsParams(
            structural_tag=json.dumps({"type": "structural_tag", "format": fmt}),
            param="tool_choice")


def _checked_schema(schema: Any, param: str, backend: str) -> Any:
    check_constraint(StructuredOutputsParams.from_schema(schema, param), backend)
    return schema


def check_tool_schemas(tools: list[dict[str, Any]]) -> None:
    """Every tool's `parameters` is a JSON schema, whatever `tool_choice` says (OpenAI's
    API checks them all): a 400 naming the first bad one. A schema a backend reads passes,
    enforceable or not, since a call that is not forced compiles nothing; `constraint`
    checks a forced call's schemas for the engine's own backend."""
    for i, t in enumerate(tools):
        check_json_schema(StructuredOutputsParams.from_schema(
            t["function"].get("parameters") or {"type": "object"},
            f"tools.{i}.function.parameters"))


# ------------------------------------------------------------- llama3_json, mistral

PYTHON_TAG, TOOL_CALLS = "<|python_tag|>", "[TOOL_CALLS]"
_JSON_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


class StateStream(ToolCallStream):
    """A stream machine whose `_<state>(content, deltas)` methods each consume what the
    buffer allows and return True to go again (`state` names the current one)."""

    state: str
    buffer: str

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buffer += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while getattr(self, f"_{self.state}")(content, deltas):
            pass
        return "".join(content), deltas


class JsonCallsStream(StateStream):
    """A run of calls written as bare JSON objects, `{"name": .., "parameters": {..}}`
    (or `"arguments"`). The call object's states are shared; a subclass says where a run
    begins (its first state) and what lies between two calls (`_between`):

        (begin) ──► OPEN ──"{"──► HEAD ──{"name": "..", "parameters": ──► ARGS ──► REST
                     ▲            │ other key order: read whole at its "}"         │ "}"
                     └─separator──┴──────────────────────── BETWEEN ◄──────────────┘

    `held` is the text read past before a run's first call (leading whitespace, the
    opening tag): content after all if no call follows. A call's text is never
    re-serialized: `arguments` is the model's own text of the value, whatever the key
    order (`_whole_call`)."""

    # states in which the text held at the end of the output is content
    FLUSH = frozenset({"start", "text", "open_list", "open", "head", "content"})

    def __init__(self, state: str) -> None:
        self.state, self.buffer, self.held, self.index = state, "", "", -1
        self.scanner = JsonValueScanner()  # the arguments value, then the rest of the call
        self.whole = JsonValueScanner()  # the call object read whole (keys in another order)
        self.scanned = 0  # how much of the buffer `whole` has read

    def finish(self) -> tuple[str, list[CallDelta]]:
        """End of output: text still held is content (a partial opening tag, a call whose
        head never parsed: cut by `max_tokens` or a stop); whitespace after a call is
        dropped; a call whose arguments began was already sent as it came."""
        held = self.held + self.buffer if self.state in self.FLUSH else ""
        self.held = self.buffer = ""
        return (held if self.index < 0 or held.strip() else ""), []

    def _not_a_call(self, content: list[str], text: str = "") -> None:
        """What was held, and `text`, is content; so is the text that follows."""
        content.append(self.held + text)
        self.held, self.state = "", "content"

    def _content(self, content: list[str], deltas: list[CallDelta]) -> bool:
        content.append(self.buffer)
        self.buffer = ""
        return False

    def _open(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Whitespace, then the `{` of a call."""
        ws = _skip_space(self.buffer, 0)
        self.held += self.buffer[:ws] if self.index < 0 else ""
        self.buffer = self.buffer[ws:]
        if not self.buffer:
            return False
        if self.buffer[0] != "{":
            self._not_a_call(content)
            return True
        self.state = "head"
        return True

    def _head(self, content: list[str], deltas: list[CallDelta]) -> bool:
        m = _JSON_HEAD.match(self.buffer)
        if m is not None:
            self._call(deltas, _json_string(m.group(1)))
            self.buffer, self.state = self.buffer[m.end():], "args"
            return True
        self.scanned += self.whole.feed(self.buffer[self.scanned:])
        if not self.whole.done:
            return False
        body, self.buffer = self.buffer[:self.scanned], self.buffer[self.scanned:]
        self.whole, self.scanned = JsonValueScanner(), 0
        call = _whole_call(body)
        if call is None:  # not JSON, no name: content, as vLLM's parsers have it
            self._not_a_call(content, body)
            return True
        self._call(deltas, *call)
        self.state = "between"
        return True

    def _call(self, deltas: list[CallDelta], name: str, arguments: str = "") -> None:
        self.index += 1
        deltas.append(CallDelta(self.index, new_call_id(), name, arguments))
        self.held, self.scanner, self.whole, self.scanned = "", JsonValueScanner(), \
            JsonValueScanner(), 0

    def _args(self, content: list[str], deltas: list[CallDelta]) -> bool:
        self.buffer = stream_arguments(self.buffer, self.scanner, self.index, deltas)
        if not self.scanner.done:
            return False
        self.state, self.scanner = "rest", JsonValueScanner()
        self.scanner.depth, self.scanner.started = 1, True  # inside the call object
        return True

    def _rest(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """The call object's other members (none, as a rule) up to its `}`."""
        self.buffer = self.buffer[self.scanner.feed(self.buffer):]
        if not self.scanner.done:
            return False
        self.state = "between"
        return True

    def _past_space(self) -> bool:
        """Drop the whitespace after a call; True when a character follows it."""
        self.buffer = self.buffer.lstrip()
        return bool(self.buffer)


def _json_string(body: str) -> str:
    """The text of a JSON string's body (between its quotes), read leniently."""
    try:
        return str(json.loads(f'"{body}"', strict=False))
    except ValueError:
        return body


def _whole_call(body: str) -> tuple[str, str] | None:
    """A call object read whole: its name and the model's own text of its arguments
    (`parameters` or `arguments`; `{}` if neither); None if it is no call (not a JSON
    object, no string `name`)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    members = _raw_members(body)
    return call["name"], members.get("parameters", members.get("arguments", "{}"))


def _raw_members(body: str) -> dict[str, str]:
    """The members of a valid JSON object's text, each value as written (not re-encoded)."""
    decoder, out = json.JSONDecoder(), {}
    at = _skip_space(body, _skip_space(body, 0) + 1)  # past "{"
    while body[at] == '"':
        key, at = decoder.raw_decode(body, at)
        at = _skip_space(body, _skip_space(body, at) + 1)  # past ":"
        _, end = decoder.raw_decode(body, at)
        out[key] = body[at:end]
        at = _skip_space(body, end)
        at = _skip_space(body, at + 1) if body[at] == "," else at
    return out


def _skip_space(text: str, at: int) -> int:
    """The first position from `at` on that holds no whitespace (or the text's end)."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class Llama3JsonStream(JsonCallsStream):
    """Llama 3.x: the answer is calls only if it begins (after whitespace) with `{` or
    `<|python_tag|>`; else all of it is content. Calls are separated by `; `."""

    def __init__(self) -> None:
        super().__init__("start")

    def _start(self, content: list[str], deltas: list[CallDelta]) -> bool:
        rest = self.buffer.lstrip()
        lead = self.buffer[:len(self.buffer) - len(rest)]
        if rest.startswith(PYTHON_TAG):
            self.held, self.buffer, self.state = lead + PYTHON_TAG, rest[len(PYTHON_TAG):], \
                "open"
        elif rest.startswith("{"):
            self.held, self.buffer, self.state = lead, rest, "head"
        elif not rest or PYTHON_TAG.startswith(rest):
            return False  # only whitespace so far, or maybe the tag
        else:
            self.state = "content"
        return True

    def _between(self, content: list[str], deltas: list[CallDelta]) -> bool:
        if not self._past_space():
            return False
        if self.buffer[0] == ";":
            self.buffer, self.state = self.buffer[1:], "open"
        else:  # text after the calls: content
            self.state = "content"
        return True


class MistralStream(JsonCallsStream):
    """Mistral: content, then `[TOOL_CALLS]` and a JSON list of calls (a bare call object
    is read too); text after the list is content, and may hold another `[TOOL_CALLS]`."""

    def __init__(self) -> None:
        super().__init__("text")
        self.in_list = False

    def _text(self, content: list[str], deltas: list[CallDelta]) -> bool:
        at = self.buffer.find(TOOL_CALLS)
        if at < 0:
            keep = len(self.buffer) - _partial_suffix(self.buffer, TOOL_CALLS)
            content.append(self.buffer[:keep])
            self.buffer = self.buffer[keep:]
            return False
        content.append(self.buffer[:at])
        self.held, self.buffer, self.state = TOOL_CALLS, self.buffer[at + len(TOOL_CALLS):], \
            "open_list"
        return True

    def _open_list(self, content: list[str], deltas: list[CallDelta]) -> bool:
        ws = _skip_space(self.buffer, 0)
        self.held, self.buffer = self.held + self.buffer[:ws], self.buffer[ws:]
        if not self.buffer:
            return False
        self.in_list = self.buffer[0] == "["
        if self.in_list:
            self.held, self.buffer = self.held + "[", self.buffer[1:]
        self.state = "open"
        return True

    def _not_a_call(self, content: list[str], text: str = "") -> None:
        """Content, and the text after it is read for `[TOOL_CALLS]` again."""
        super()._not_a_call(content, text)
        self.state = "text"

    def _between(self, content: list[str], deltas: list[CallDelta]) -> bool:
        if not self._past_space():
            return False
        if self.in_list and self.buffer[0] == ",":
            self.buffer, self.state = self.buffer[1:], "open"
            return True
        if self.in_list and self.buffer[0] == "]":
            self.buffer = self.buffer[1:]
        self.state = "after"
        return True

    def _after(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Text after the list: content from its first non-space character."""
        if not self._past_space():
            return False
        self.state = "text"
        return True


def _call_tags(tools: list[dict[str, Any]], choice: str | None, backend: str,
               args_key: str) -> list[dict[str, Any]]:
    """One structural tag per tool (only the named one if `choice` names one): a call
    object `{"name": .., "<args_key>": <compact JSON of its schema>}`."""
    return [{"type": "tag",
             "begin": f'{{"name": {json.dumps(t["function"]["name"])}, "{args_key}": ',
             "content": {"type": "json_schema", "json_schema": _checked_schema(
                 t["function"].get("parameters") or {"type": "object"},
                 f"tools.{i}.function.parameters", backend)},
             "end": "}"}
            for i, t in enumerate(tools) if choice is None or t["function"]["name"] == choice]


def _calls_tag(fmt: dict[str, Any]) -> StructuredOutputsParams:
    return StructuredOutputsParams(
        structural_tag=json.dumps({"type": "structural_tag", "format": fmt}),
        param="tool_choice")


class Llama3JsonToolParser(ToolParser):
    """vLLM's `llama3_json`: `{"name": "f", "parameters": {...}}; {...}` (Llama 3.1-3.3
    Instruct's JSON tool calls), optionally after `<|python_tag|>`. A forced call is
    written without the tag."""

    def stream(self) -> ToolCallStream:
        return Llama3JsonStream()

    def constraint(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool,
                   backend: str = "auto") -> StructuredOutputsParams:
        return _calls_tag({"type": "tags_with_separator", "separator": "; ",
                           "tags": _call_tags(tools, choice, backend, "parameters"),
                           "at_least_one": True,
                           "stop_after_first": not parallel or choice is not None})


class MistralToolParser(ToolParser):
    """vLLM's `mistral` (Instruct v0.3's format): `[TOOL_CALLS][{"name": "f", "arguments":
    {...}}, ...]`. A forced answer is that list, with one call or (`parallel`) several.

    Where the tokenizer has `[TOOL_CALLS]` as a special token, an unforced call is seen
    only with `skip_special_tokens: false`, which the worker sets for a request with tools
    (`special_tokens`, as vLLM's parser does); a forced one is written in plain-text
    tokens (grammars never admit special tokens)."""

    special_tokens = True

    def stream(self) -> ToolCallStream:
        return MistralStream()

    def constraint(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool,
                   backend: str = "auto") -> StructuredOutputsParams:
        calls = {"type": "tags_with_separator", "separator": ", ",
                 "tags": _call_tags(tools, choice, backend, "arguments"),
                 "at_least_one": True, "stop_after_first": not parallel or choice is not None}
        return _calls_tag({"type": "sequence", "elements": [
            {"type": "const_string", "value": TOOL_CALLS + "["}, calls,
            {"type": "const_string", "value": "]"}]})


# ------------------------------------------------------------------------ pythonic

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonListScanner:
    """Finds where a Python list literal ends in a stream of characters: brackets of
    every kind nested, strings in either quote (escapes read) passed over."""

    def __init__(self) -> None:
        self.depth, self.quote, self.escape, self.done = 0, "", False, False

    def feed(self, text: str) -> int:
        """How many of `text`'s characters belong to the list (all, until it ends)."""
        for i, ch in enumerate(text):
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class PythonicStream(StateStream):
    """The answer is calls only if it begins (after whitespace, and Llama 4's
    `<|python_start|>`) with `[`; else all of it is content. The list is held until its
    `]`, then read whole with Python's parser (`python_calls`): a list that is no list of
    calls is content. Text after it (past `<|python_end|>`) is content."""

    def __init__(self) -> None:
        self.state, self.buffer, self.held, self.index = "start", "", "", -1
        self.tagged = False
        self.scanner, self.scanned = PythonListScanner(), 0

    def finish(self) -> tuple[str, list[CallDelta]]:
        """End of output: a list never closed (cut by `max_tokens` or a stop) is content,
        with what opened it, as is a partial `<|python_start|>`."""
        held = self.held + self.buffer
        self.held = self.buffer = ""
        return (held if self.index < 0 or held.strip() else ""), []

    def _start(self, content: list[str], deltas: list[CallDelta]) -> bool:
        rest = self.buffer.lstrip()
        lead = self.buffer[:len(self.buffer) - len(rest)]
        if not self.tagged and rest.startswith(PYTHON_START):
            self.held, self.buffer = self.held + lead + PYTHON_START, rest[len(PYTHON_START):]
            self.tagged = True
            return True
        if rest.startswith("["):
            self.held, self.buffer, self.state = self.held + lead, rest, "list"
            return True
        if not rest or (not self.tagged and PYTHON_START.startswith(rest)):
            return False  # only whitespace so far, or maybe the tag
        self.state = "content"
        content.append(self.held)
        self.held = ""
        return True

    def _list(self, content: list[str], deltas: list[CallDelta]) -> bool:
        self.scanned += self.scanner.feed(self.buffer[self.scanned:])
        if not self.scanner.done:
            return False
        body, self.buffer = self.buffer[:self.scanned], self.buffer[self.scanned:]
        calls = python_calls(body)
        if calls is None:  # no list of calls: content, as vLLM's parser has it
            content.append(self.held + body)
            self.held, self.state = "", "content"
            return True
        for name, arguments in calls:
            self.index += 1
            deltas.append(CallDelta(self.index, new_call_id(), name, arguments))
        self.held, self.state = "", "after"
        return True

    def _after(self, content: list[str], deltas: list[CallDelta]) -> bool:
        """Whitespace and `<|python_end|>` after the list; content from the first other
        character."""
        rest = self.buffer.lstrip()
        if self.tagged and rest.startswith(PYTHON_END):
            self.buffer, self.tagged = rest[len(PYTHON_END):], False
            return True
        if not rest or (self.tagged and PYTHON_END.startswith(rest)):
            self.buffer = rest
            return False
        self.buffer, self.state = rest, "content"
        return True

    def _content(self, content: list[str], deltas: list[CallDelta]) -> bool:
        content.append(self.buffer)
        self.buffer = ""
        return False


def python_calls(text: str) -> list[tuple[str, str]] | None:
    """`[f(a=1, b="x"), g()]` -> [(name, JSON text of the keyword arguments), ...]; None
    if `text` is not a non-empty list of calls of plain names with literal keyword
    arguments. Parsed, never evaluated (`ast.literal_eval` on each value); the values
    are Python literals, so the arguments are re-encoded as JSON."""
    import ast

    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name)
                    or node.args or any(k.arg is None for k in node.keywords)):
                return None
            arguments = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    """vLLM's `pythonic` (Llama 3.2 and Llama 4 with their pythonic templates, ToolACE):
    `[get_weather(city="Paris"), get_time()]`. Calls go out whole when the list closes
    (each one delta: name and arguments). A forced call is refused: its arguments are
    Python, which no grammar here writes from a JSON schema."""

    def stream(self) -> ToolCallStream:
        return PythonicStream()

    def constraint(self, tools: list[dict[str, Any]], choice: str | None, parallel: bool,
                   backend: str = "auto") -> StructuredOutputsParams:
        raise InvalidRequestError(
            "tool_choice 'required' or a named function is not supported with the "
            "'pythonic' tool-call parser (its calls are Python, which no grammar here "
            "writes); use 'auto', or a parser with JSON calls (hermes, llama3_json, "
            "mistral)", param="tool_choice")


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser,
                                             "llama3_json": Llama3JsonToolParser,
                                             "mistral": MistralToolParser,
                                             "pythonic": PythonicToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise InvalidRequestError(f"unknown tool-call parser {name!r} "
                                  f"(known: {', '.join(sorted(TOOL_PARSERS))})",
                                  param="tool_call_parser")
    return TOOL_PARSERS[name]()
