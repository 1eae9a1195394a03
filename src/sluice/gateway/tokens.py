"""Prompt token counting at admission, from the model's real tokenizer.

Tokens-per-minute limits are only exact if the gateway counts what the engine will
count, so it reads the prompt through the one prompt view (`sluice.protocol.prompt`:
the same messages, template and tokenizer rules as the worker) and keeps the ids in the
process's `TokenCache`. `PromptTokenCounter` is the default
`count_prompt_tokens(model, body) -> int`: it loads the served model's tokenizer through
`sluice.engine.tokenizer` (torch-free). If no tokenizer can be loaded it falls back to a
chars/4 estimate and says so (`estimated` is set and a warning is logged once).
Upstream's reported `usage.prompt_tokens` replaces the count when the response ends.

`prompt_tokens(model, view)` also hands the ids themselves to the next hop (the router
in the same process, see `middleware.Exchange.upstream_scope`), so a prompt is
tokenized once on the whole path.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from sluice.protocol.prompt import (
    CHAT,
    COMPLETION,
    MESSAGES,
    RESPONSES,
    IdsHint,
    PromptView,
    TokenCache,
    Tokenizer,
    fingerprint,
    kept,
    make_hint,
    prompt_view,
)

logger = logging.getLogger(__name__)

CountPromptTokens = Callable[[str | None, dict[str, Any]], int]


def kind_of(body: Mapping[str, Any]) -> str:
    """The request kind a body is: Anthropic's carries `system`, which OpenAI chat bodies
    may not (the worker refuses it), or Anthropic-only shapes (tools with `input_schema`,
    `tool_use` / `tool_result` blocks); without them both read the same. A body without
    `messages` is a completion's, or a Responses request's (input items, instructions)."""
    if "messages" not in body:  # a Responses body's list of input items (a string input
        # reads the same as a completion prompt)
        items = body.get("input")
        responses = isinstance(items, list) and any(isinstance(i, dict) for i in items)
        return RESPONSES if responses or "instructions" in body else COMPLETION
    return MESSAGES if "system" in body or _anthropic_tools(body) else CHAT


def _anthropic_tools(body: Mapping[str, Any]) -> bool:
    tools = body.get("tools")
    messages = body.get("messages")
    blocks = [b for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
              for b in m["content"]] if isinstance(messages, list) else []
    return any(isinstance(t, dict) and "input_schema" in t
               for t in (tools if isinstance(tools, list) else [])) or any(
        isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result") for b in blocks)


class PromptTokenCounter:
    """`count_prompt_tokens` backed by real tokenizers, one cached per model.

    `tokenizers` maps served model names to tokenizer sources (HF dir, hub name, .gguf);
    a model not in the map uses `default_source` (None = the default SmolLM2 GGUF).
    """

    def __init__(self, tokenizers: Mapping[str, str] | None = None,
                 default_source: str | None = None,
                 loader: Callable[[str | None], Tokenizer] | None = None,
                 cache: TokenCache | None = None) -> None:
        self.sources = dict(tokenizers or {})
        self.default_source = default_source
        self.loader = loader
        self.estimated = False
        self.cache = cache or TokenCache()
        self._cache: dict[str | None, tuple[Tokenizer, str] | None] = {}
        self._lock = threading.Lock()

    def is_ready(self, model: str | None) -> bool:
        """True once this model's tokenizer is loaded (counting is then cheap)."""
        return self.sources.get(model or "", self.default_source) in self._cache

    def tokenizer(self, model: str | None) -> tuple[Tokenizer, str] | None:
        """The model's tokenizer and its fingerprint (None: none loads, estimating)."""
        source = self.sources.get(model or "", self.default_source)
        with self._lock:
            if source not in self._cache:
                tok = self._load(source)
                self._cache[source] = (tok, fingerprint(tok)) if tok is not None else None
            return self._cache[source]

    def _load(self, source: str | None) -> Tokenizer | None:
        try:
            if self.loader is not None:
                return self.loader(source)
            from sluice.engine.tokenizer import load_tokenizer

            return load_tokenizer(source)
        except Exception as exc:  # any failure: fall back, loudly
            logger.warning("no tokenizer for %r (%s); counting prompt tokens as chars/4 "
                           "(an estimate)", source, exc)
            self.estimated = True
            return None

    def __call__(self, model: str | None, body: dict[str, Any]) -> int:
        view = prompt_view(kind_of(body), body)
        counted = self.prompt_tokens(model, view)
        return counted[0] if counted is not None else estimate_view(view)

    def prompt_tokens(self, model: str | None, view: PromptView
                      ) -> tuple[int, IdsHint | None] | None:
        """The prompt's token count and, for a chat prompt, its ids as a hint for the
        next hop; None without a tokenizer."""
        loaded = self.tokenizer(model)
        if loaded is None:
            return None
        tok, fp = loaded
        name = model or ""
        if view.messages is None:
            return self.cache.count(tok, name, view), None
        text = self.cache.chat_text(tok, name, view)
        ids = self.cache.tokens(tok, name, text, special=False).ids
        return len(kept(ids, view)), make_hint(fp, text, ids)


def _estimate(text: str) -> int:
    return (len(text) + 3) // 4


def estimate_view(view: PromptView) -> int:
    """chars/4 of the prompt, each text capped at `view.keep` tokens."""
    cap = view.keep if view.keep is not None else 2**63
    if view.messages is not None:
        calls = [json.dumps(m["tool_calls"]) for m in view.messages if m.get("tool_calls")]
        tools = [json.dumps(view.tools)] if view.tools else []
        return min(cap, _estimate("".join([m["content"] for m in view.messages]
                                          + calls + tools)))
    return sum(min(cap, len(t) if isinstance(t, list) else _estimate(t)) for t in view.texts)


def estimate_prompt_tokens(model: str | None, body: dict[str, Any]) -> int:
    """chars/4 for every input: the counter to inject where no tokenizer is wanted."""
    return estimate_view(prompt_view(kind_of(body), body))
