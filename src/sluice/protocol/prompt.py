"""One prompt view: from an OpenAI or Anthropic request to exactly what the engine sees.

The gateway counts prompt tokens (TPM limits, budgets), the router hashes them (prefix
matching), the worker feeds them to the engine. They agree only if all three read the
same messages through the same template and tokenizer, so there is one set of rules,
here, and one token-id cache:

    prompt_view(kind, body)   -> PromptView: the chat messages the template sees, or the
                                 completion prompt(s) as text or client token ids
    templated(tok, view)      -> the text that is tokenized (chat template applied)
    TokenCache                   LRU {(model, templated text): PromptTokens}, one per
                                 process, shared by whoever needs ids there; also the
                                 templated texts, by (tokenizer, model, messages, tools)
                                 (`chat_text`: a template render costs ~200 us, a lookup ~1)
    PromptTokens                 ids, their block hashes (per block size, computed once)
    IdsHint                      the ids sent to the next hop (`x-sluice-prompt-ids`):
                                 tokenizer fingerprint, digest of the templated text,
                                 the ids; the worker uses them only if both match its own
    ResumeIds                    output ids a migrated request already generated
                                 (`x-sluice-resume-ids`): the generating worker's
                                 tokenizer fingerprint and the ids; the worker appends
                                 them to the prompt's ids as output, and continues

Rules (the worker's, which the engine sees; `test_prompt_equivalence` holds all three
hops to them):

- chat (`/v1/chat/completions`): every message `{role, content}`; role `developer` is
  `system`; content is a string, or a list of `{"type": "text", "text": ...}` parts
  joined without separator; any other part (image, audio, file) is a 400 naming
  `messages.N.content`. An assistant turn's `tool_calls` reach the template as
  `{"id", "type", "function": {"name", "arguments"}}` with `arguments` parsed into an
  object (what Hugging Face templates expect); a `tool` turn keeps `tool_call_id`.
  The request's `tools` (OpenAI's shape) reach the template as the worker's parsed
  request dumps them: `{"type", "function": {"name", "description"?, "parameters"?,
  "strict"?}}` in that key order, whatever order the client wrote (the template
  writes them as JSON, so key order is part of the prompt).
- Anthropic (`/v1/messages`): the chat view of the request's OpenAI translation
  (`anthropic.chat_prompt`, the worker's own): `system` (a string or text blocks)
  first, as a system message, only when its text is non-empty; text blocks joined;
  `tool_use` blocks as the assistant's `tool_calls`, `tool_result` blocks as `tool`
  messages; `tools` as OpenAI tools.
- Responses (`/v1/responses`): the chat view of its translation (`responses.chat_prompt`,
  the worker's own): `instructions` first, as a system message, when non-empty; the
  `input` string as a user message, or its items: messages (text parts joined,
  `developer` as `system`), `function_call` items as the assistant's `tool_calls`,
  `function_call_output` items as `tool` messages; function `tools` as OpenAI tools.
- the template is applied with `add_generation_prompt=True` (a chat request's own
  `add_generation_prompt: false` without it) and a chat request's `chat_template_kwargs`
  (vLLM's: more template variables; not one of the request's own), and tokenized
  without special tokens (the template writes them); a completion prompt is tokenized
  with them.
- a final message to continue (vLLM's `continue_final_message`; an Anthropic request
  whose last message is an assistant one with text, a prefill): the template is applied
  without the generation prompt and its text cut after that message's content
  (`continue_final`, Hugging Face's rule), so the model goes on from it.
- vLLM's `truncate_prompt_tokens: k` (k >= 1) keeps each prompt's last k tokens
  (`PromptView.keep`, `kept`): the gateway counts and the router hashes those, as the
  engine reads them (-1, the context length, is the worker's to apply; the ids hint
  still carries the whole prompt's ids, which the worker cuts the same way).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from sluice.protocol import anthropic, responses
from sluice.protocol.block_hash import hash_blocks
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import content_text

CHAT, COMPLETION, MESSAGES, RESPONSES = "chat", "completion", "messages", "responses"
EMBEDDINGS = "embeddings"  # its `input` is read as a completion's `prompt`
SCORE, RERANK = "score", "rerank"  # their texts: `text_1` then `text_2`; `query`, `documents`
# the endpoints a worker runs the model for and the kind of prompt each takes (router,
# worker, gateway)
KIND_OF_PATH = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION,
                "/v1/messages": MESSAGES, "/v1/responses": RESPONSES,
                "/v1/embeddings": EMBEDDINGS, "/v1/score": SCORE, "/v1/rerank": RERANK,
                # vLLM's classification API (`/classify`; `input` read as embeddings' is)
                "/v1/classify": EMBEDDINGS, "/classify": EMBEDDINGS,
                "/pooling": EMBEDDINGS}  # (vLLM's: pooled data of any task)
IDS_HEADER = "x-sluice-prompt-ids"
RESUME_HEADER = "x-sluice-resume-ids"
TOKENIZER_HEADER = "x-sluice-tokenizer"  # a worker's fingerprint, on responses with token ids
INLINE_TOKENIZE_CHARS = 16 * 1024  # longer texts are tokenized on a worker thread
MAX_HINT_TOKENS = 4096  # longer prompts are not sent in a header (header size limits)
_PROBE = "Tokenizer fingerprint: Hello, wörld! 1234 <|im_start|> \t\n ünïcödé 漢字 🙂"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class PromptView:
    """What a request asks the model to read: chat `messages`, or completion `texts`
    (each a string or a list of client token ids)."""

    messages: list[dict[str, Any]] | None = None
    texts: tuple[str | list[int], ...] = ()
    tools: list[dict[str, Any]] | None = None
    continue_final: bool = False  # continue the last message rather than answer it
    generation_prompt: bool = True  # chat's add_generation_prompt (open the answer's turn)
    template_kwargs: dict[str, Any] | None = None  # chat's chat_template_kwargs (vLLM's)
    keep: int | None = None  # vLLM's truncate_prompt_tokens, where positive: the last k

    @property
    def chars(self) -> int:
        if self.messages is not None:
            tools = len(json.dumps(self.tools)) if self.tools else 0
            return tools + sum(len(m["content"]) + 8 + len(json.dumps(m.get("tool_calls", "")))
                               for m in self.messages)
        return sum(len(t) for t in self.texts if isinstance(t, str))


# -- messages ----------------------------------------------------------------------------


def chat_messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise InvalidRequestError("'messages' must be a list", param="messages")
    return [template_message(m, f"messages.{i}") for i, m in enumerate(raw)]


def template_message(m: Any, param: str) -> dict[str, Any]:
    """One chat message as the template sees it (rules in the module docstring)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidRequestError("each message needs a string 'role'", param=param)
    role = "system" if m["role"] == "developer" else m["role"]
    content = m.get("content")
    out: dict[str, Any] = {"role": role, "content": "" if content is None and (
        m.get("tool_calls") or role == "assistant") else content_text(content, f"{param}.content")}
    if m.get("tool_calls"):
        out["tool_calls"] = [_template_call(c, f"{param}.tool_calls.{j}")
                             for j, c in enumerate(m["tool_calls"])]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise InvalidRequestError("a tool message needs 'tool_call_id'",
                                      param=f"{param}.tool_call_id")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _template_call(call: Any, param: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError("a tool call needs function.name", param=f"{param}.function")
    try:
        arguments = json.loads(fn.get("arguments") or "{}")
    except (TypeError, ValueError):
        raise InvalidRequestError("function.arguments must be a JSON text",
                                  param=f"{param}.function.arguments") from None
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def template_tools(raw: Any) -> list[dict[str, Any]] | None:
    """A chat request's `tools` as the template sees them (rules in the module
    docstring); None for none."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise InvalidRequestError("'tools' must be a list", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequestError("a tool needs a 'function' object",
                                      param=f"tools.{i}.function")
        tools.append({"type": tool.get("type"),
                      "function": {k: fn[k] for k in _FUNCTION_KEYS if k in fn}})
    return tools


def completion_texts(prompt: Any) -> tuple[str | list[int], ...]:
    """`prompt`: a string, a list of token ids, or a list of either. A token id outside
    [0, 2**32) is no token of any vocabulary (nor can it be hashed into a block): a 400
    naming `prompt` here, at whichever hop reads it first (it was a 502 through `sluice
    serve`: the router's block hash failed on it)."""
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return (_token_ids(prompt),)
    if isinstance(prompt, list) and all(isinstance(p, str) or isinstance(p, list) and all(
            isinstance(t, int) for t in p) for p in prompt):
        return tuple(p if isinstance(p, str) else _token_ids(p) for p in prompt)
    raise InvalidRequestError("prompt must be a string, a list of token ids, or a list of "
                              "either", param="prompt")


def _token_ids(ids: list[int]) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < 2**32), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is out of range [0, 2**32)",
                                  param="prompt")
    return list(ids)


def prompt_view(kind: str, body: Mapping[str, Any]) -> PromptView:
    """The one view of a request's prompt (rules in the module docstring); 400 for a
    prompt the worker would refuse too."""
    view = _view(kind, body)
    keep = body.get("truncate_prompt_tokens")
    if kind in (MESSAGES, RESPONSES) or not isinstance(keep, int) or isinstance(keep, bool) \
            or keep < 1:
        return view
    return replace(view, keep=keep)


def kept(ids: list[int], view: PromptView) -> list[int]:
    """The ids of a prompt the engine reads: its last `view.keep` (all without)."""
    return ids if view.keep is None or len(ids) <= view.keep else ids[-view.keep:]


def _view(kind: str, body: Mapping[str, Any]) -> PromptView:
    if kind == RESPONSES:
        try:
            return _chat_view(kind, responses.chat_prompt(body))
        except InvalidRequestError as exc:  # named as the Responses client wrote it
            exc.param = responses.responses_param(exc.param)
            raise
    if kind == MESSAGES:
        return _chat_view(kind, anthropic.chat_prompt(body))
    if kind == CHAT:
        return _chat_view(kind, body)
    if kind == SCORE:
        return PromptView(texts=_texts(body, "text_1") + _texts(body, "text_2"))
    if kind == RERANK:
        return PromptView(texts=_texts(body, "query", text=True, texts=False)
                          + _texts(body, "documents", text=False))
    if kind == EMBEDDINGS and "messages" in body and "input" not in body:  # vLLM's chat form
        return replace(_chat_view(CHAT, body), generation_prompt=body.get(
            "add_generation_prompt") is True)  # (off by default: nothing is generated)
    return PromptView(texts=completion_texts(body.get("prompt", body.get("input", ""))))


def _texts(body: Mapping[str, Any], name: str, text: bool = True, texts: bool = True
           ) -> tuple[str, ...]:
    """A scoring request's texts under `name`: a string (if `text`) or a non-empty list
    of strings (if `texts`); else a 400 naming it."""
    value = body.get(name)
    if text and isinstance(value, str):
        return (value,)
    if texts and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    shapes = [s for s, ok in (("a string", text), ("a non-empty list of strings", texts)) if ok]
    raise InvalidRequestError(f"'{name}' must be {' or '.join(shapes)}", param=name)


def _chat_view(kind: str, body: Mapping[str, Any]) -> PromptView:
    """The view of a chat request's prompt half (a translation's, for Anthropic's and
    the Responses API's)."""
    messages = chat_messages(body.get("messages"))
    prefill = kind == MESSAGES and anthropic.is_prefill(messages)
    return PromptView(messages=messages, tools=template_tools(body.get("tools")),
                      continue_final=prefill or body.get("continue_final_message") is True,
                      generation_prompt=body.get("add_generation_prompt") is not False,
                      template_kwargs=check_template_kwargs(body.get("chat_template_kwargs")))


# the request's own template variables and apply_chat_template's parameters
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize"})


def check_template_kwargs(raw: Any) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs`: more variables for the chat template (an object;
    empty or null: none). One that would replace the request's own (`messages`,
    `tools`, `add_generation_prompt`) is a 400, as is a special token's name (the
    tokenizer's check)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object",
                                  param="chat_template_kwargs")
    taken = sorted(RESERVED_TEMPLATE_KWARGS & set(raw))
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(taken)} "
                                  "(the request's own)", param="chat_template_kwargs")
    return raw or None


# -- tokens --------------------------------------------------------------------------------


def templated(tok: Tokenizer, view: PromptView) -> str:
    """The chat template applied to the view's messages (chat views only); an error the
    model's own template raises is a 400 naming `messages`."""
    assert view.messages is not None
    answer = view.generation_prompt and not view.continue_final
    extra = view.template_kwargs or {}
    try:
        if view.tools:
            text = tok.apply_chat_template(view.messages, add_generation_prompt=answer,
                                           tools=view.tools, **extra)
        else:
            text = tok.apply_chat_template(view.messages, add_generation_prompt=answer,
                                           **extra)
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2 errors raised by the model's own template
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc
    if not view.continue_final:
        return text
    return continue_final(text, view.messages[-1]["content"])


def continue_final(rendered: str, final: str) -> str:
    """`rendered` (a template applied without the generation prompt) cut right after the
    final message's content, so generation continues it (Hugging Face's
    `continue_final_message`: the last occurrence of the stripped content; its trailing
    whitespace kept where the template kept it). 400 if the template dropped it."""
    stripped = final.strip()
    at = rendered.rfind(stripped) if stripped else -1
    if at < 0:
        raise InvalidRequestError("the final message to continue is empty or does not appear "
                                  "in the chat template's text", param="messages")
    kept = final.lstrip()
    end = at + (len(kept) if rendered[at:at + len(kept)] == kept else len(stripped))
    return rendered[:end]


ViewKey = tuple[tuple[tuple[str, str, str | None, str | None], ...], str | None, bool, bool,
                str | None]


def view_key(view: PromptView) -> ViewKey:
    """A chat view as a hashable value: equal keys, equal views (JSON text for the
    nested tool calls and tools; their key order is part of the prompt)."""
    assert view.messages is not None
    messages = tuple((m["role"], m["content"], m.get("tool_call_id"),
                      json.dumps(m["tool_calls"]) if "tool_calls" in m else None)
                     for m in view.messages)
    return (messages, json.dumps(view.tools) if view.tools else None, view.continue_final,
            view.generation_prompt,
            json.dumps(view.template_kwargs, sort_keys=True) if view.template_kwargs else None)


@dataclass
class PromptTokens:
    """A prompt's token ids and, computed once per block size, their block hashes."""

    ids: list[int]
    _hashes: dict[tuple[int, bytes], tuple[int, ...]] = field(default_factory=dict)

    def block_hashes(self, block_size: int, extra: bytes = b"") -> tuple[int, ...]:
        """`hash_blocks` of the ids, cached per (block size, `extra`: a LoRA adapter's
        cache salt, so an adapter's blocks are never a base model's)."""
        hashes = self._hashes.get((block_size, extra))
        if hashes is None:
            hashes = tuple(hash_blocks(self.ids, block_size, extra))
            self._hashes[(block_size, extra)] = hashes
        return hashes


class TokenCache:
    """LRU of token ids by (model, templated prompt): one per process, shared by the
    gateway's counter and the router's hasher (and anything else that needs ids), so a
    prompt is tokenized once however many of them read it. Thread-safe."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, str], PromptTokens] = OrderedDict()
        self._lock = threading.Lock()  # long prompts are tokenized on worker threads
        self._texts: OrderedDict[tuple[int, str, ViewKey], str] = OrderedDict()
        self._keep: dict[int, Tokenizer] = {}
        self.hits = self.misses = 0

    def get(self, model: str, text: str) -> PromptTokens | None:
        with self._lock:
            found = self._items.get((model, text))
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end((model, text))
            self.hits += 1
            return found

    def put(self, model: str, text: str, ids: list[int]) -> PromptTokens:
        with self._lock:
            tokens = self._items[(model, text)] = PromptTokens(ids)
            if len(self._items) > self.size:
                self._items.popitem(last=False)
            return tokens

    def chat_text(self, tok: Tokenizer, model: str, view: PromptView) -> str:
        """`templated(tok, view)`, rendered once per (tokenizer, model, messages, tools):
        the view's messages hold only role, content, tool calls and tool call id, all
        in the key, so equal keys render equal text. A template that reads the clock
        (`strftime_now`) is rendered every time."""
        if "strftime_now" in (getattr(tok, "chat_template", None) or ""):
            return templated(tok, view)
        key = (id(tok), model, view_key(view))
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        text = templated(tok, view)
        with self._lock:
            self._keep[id(tok)] = tok  # the id in the key stays this tokenizer's
            self._texts[key] = text
            if len(self._texts) > self.size:
                self._texts.popitem(last=False)
        return text

    def tokens(self, tok: Tokenizer, model: str, text: str, *, special: bool) -> PromptTokens:
        """Look up or tokenize `text` (`special`: add the tokenizer's special tokens, as
        a completion prompt is; a templated chat prompt already holds them)."""
        key = cache_key(text, special)
        return self.get(model, key) or self.put(model, key, tok.encode(
            text, add_special_tokens=special))

    def chat_tokens(self, tok: Tokenizer, model: str, view: PromptView) -> PromptTokens:
        return self.tokens(tok, model, self.chat_text(tok, model, view), special=False)

    def count(self, tok: Tokenizer, model: str, view: PromptView) -> int:
        """The prompt's tokens as the engine reads them (each text cut to `view.keep`)."""
        if view.messages is not None:
            return len(kept(self.chat_tokens(tok, model, view).ids, view))
        return sum(len(kept(t if isinstance(t, list) else self.tokens(
            tok, model, t, special=True).ids, view)) for t in view.texts)


def cache_key(text: str, special: bool) -> str:
    """The text plus how it is tokenized: the same key always means the same ids."""
    return "\0special\0" + text if special else text


# -- passing ids to the next hop -----------------------------------------------------------


def fingerprint(tok: Tokenizer) -> str:
    """A short identity of a tokenizer: its ids for a probe text (two processes that load
    the same tokenizer agree; different vocabularies almost surely do not)."""
    ids = tok.encode(_PROBE, add_special_tokens=True)
    return hashlib.blake2b(struct.pack(f"<{len(ids)}I", *ids), digest_size=6).hexdigest()


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


@dataclass(frozen=True)
class IdsHint:
    """Prompt ids as the previous hop computed them, and what they are valid for."""

    fingerprint: str
    digest: str
    ids: list[int]

    def encode(self) -> bytes:
        """The header value; made once per hint (a cached prompt's hint is one object, and
        in `sluice serve` the gateway's header and the router's are the same bytes)."""
        encoded: bytes | None = self.__dict__.get("_encoded")
        if encoded is None:
            encoded = f"{self.fingerprint}.{self.digest}.".encode() + _pack(self.ids)
            object.__setattr__(self, "_encoded", encoded)  # not a field: eq, hash unchanged
        return encoded

    @classmethod
    def decode(cls, value: bytes | str) -> IdsHint | None:
        """None for anything malformed: a bad hint only costs a tokenization."""
        try:
            raw = value.encode("latin-1") if isinstance(value, str) else value
            fp, dg, packed = raw.split(b".", 2)
            return cls(fp.decode(), dg.decode(), _unpack(packed))
        except (ValueError, struct.error):
            return None

    def ids_for(self, tokenizer_fingerprint: str, key: str) -> list[int] | None:
        """The ids, if this tokenizer made them from exactly this text (`cache_key`)."""
        if self.fingerprint == tokenizer_fingerprint and self.digest == digest(key):
            return self.ids
        return None


# A request as a layer in front read it in this process, for the layer behind it (the
# gateway's, for the router in `sluice serve`): `scope["extensions"][READ_REQUEST]`.
READ_REQUEST = "sluice.read_request"


@dataclass(frozen=True)
class ReadRequest:
    """What the layer in front read from a request's body: its JSON object, its prompt
    view (None: not read) and the prompt's ids (None: not tokenized). Valid only for
    exactly these `body` bytes (the reader checks identity), which the object describes
    field for field: the layer that made it changed both together."""

    body: bytes
    payload: dict[str, Any]
    kind: str | None = None  # the prompt kind `view` was read as (KIND_OF_PATH)
    view: PromptView | None = None
    hint: IdsHint | None = None


@dataclass(frozen=True)
class ResumeIds:
    """Output ids a migrated request already generated, and the tokenizer they are of
    (the generating worker's fingerprint, from its `x-sluice-tokenizer` header)."""

    fingerprint: str
    ids: list[int]

    def encode(self) -> bytes:
        return self.fingerprint.encode() + b"." + _pack(self.ids)

    @classmethod
    def decode(cls, value: bytes | str) -> ResumeIds | None:
        """None for anything malformed (the worker refuses the request: a 400)."""
        try:
            raw = value.encode("latin-1") if isinstance(value, str) else value
            fp, packed = raw.split(b".", 1)
            return cls(fp.decode(), _unpack(packed))
        except (ValueError, struct.error):
            return None


def _pack(ids: Sequence[int]) -> bytes:
    return base64.b64encode(struct.pack(f"<{len(ids)}I", *ids))


def _unpack(packed: bytes) -> list[int]:
    data = base64.b64decode(packed, validate=True)
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def make_hint(tok_fingerprint: str, key: str, ids: Sequence[int]) -> IdsHint | None:
    """The hint for ids made from cache key `key` (None when too long for a header)."""
    if len(ids) > MAX_HINT_TOKENS:
        return None
    return IdsHint(tok_fingerprint, digest(key), list(ids))


async def encode_prompt(tok: Tokenizer, text: str, *, special: bool,
                        hint: IdsHint | None = None) -> list[int]:
    """The engine's ids for `text`: the previous hop's (`hint`) when its tokenizer and
    text are this one's, else tokenized here: inline when short, on a worker thread when
    long, so the event loop keeps serving other requests meanwhile."""
    if hint is not None:
        ids = hint.ids_for(fingerprint(tok), cache_key(text, special))
        if ids is not None:
            return ids
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tok.encode(text, add_special_tokens=special)
    return await asyncio.to_thread(tok.encode, text, add_special_tokens=special)
