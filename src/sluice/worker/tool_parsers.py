"""Tool calls in a model's text: read them (whole or streamed) and force them (grammar).

A tool-call parser knows one model family's call syntax (vLLM's `--tool-call-parser`).
`hermes`, the default, reads the convention of ChatML tool templates (Hermes, Qwen,
sluice's own `chatml_tools.jinja`):

    some text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

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
    """One model family's tool-call syntax (see the module docstring)."""

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
        try:
            call = json.loads(body)
            name, args = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            content.append(OPEN + body + CLOSE)
            return True
        self.index += 1
        deltas.append(CallDelta(self.index, new_call_id(), str(name), json.dumps(args)))
        return True

    def _args(self, content: list[str], deltas: list[CallDelta]) -> bool:
        if not self.scanner.started:  # whitespace before the value is not part of it
            self.buffer = self.buffer.lstrip()
        used = self.scanner.feed(self.buffer)
        piece, self.buffer = self.buffer[:used], self.buffer[used:]
        if piece:
            deltas.append(CallDelta(self.index, arguments=piece))
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


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise InvalidRequestError(f"unknown tool-call parser {name!r} "
                                  f"(known: {', '.join(sorted(TOOL_PARSERS))})",
                                  param="tool_call_parser")
    return TOOL_PARSERS[name]()
