"""Prompt token counting at admission, from the model's real tokenizer.

Tokens-per-minute limits are only exact if the gateway counts what the engine will
count. `PromptTokenCounter` is the default `count_prompt_tokens(model, body) -> int`:
it loads the served model's tokenizer through `sluice.engine.tokenizer` (torch-free),
renders chat bodies (OpenAI `messages`, Anthropic `system` + `messages`) through the
model's chat template, and counts completions/embeddings inputs (text or token ids)
directly. If no tokenizer can be loaded it falls back to a chars/4 estimate and says
so (`estimated` is set and a warning is logged once). Upstream's reported
`usage.prompt_tokens` replaces the count when the response ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol

logger = logging.getLogger(__name__)

CountPromptTokens = Callable[[str | None, dict[str, Any]], int]


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


def _text_of(content: Any) -> str:
    """OpenAI/Anthropic content (string or list of parts/blocks) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(part.get("text", "")) if isinstance(part, dict) else str(part)
                       for part in content)
    return str(content)


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """Messages as `{"role", "content": str}` for templating; None if not a chat body."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    out = []
    if body.get("system") is not None:  # Anthropic
        out.append({"role": "system", "content": _text_of(body["system"])})
    for m in messages:
        if isinstance(m, dict):
            out.append({"role": str(m.get("role", "user")), "content": _text_of(m.get("content"))})
    return out


def _raw_inputs(body: Mapping[str, Any]) -> list[Any]:
    value = body.get("prompt", body.get("input"))
    if value is None:
        return []
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and isinstance(value[0], int)):
        return [value]
    return list(value) if isinstance(value, list) else [value]


class PromptTokenCounter:
    """`count_prompt_tokens` backed by real tokenizers, one cached per model.

    `tokenizers` maps served model names to tokenizer sources (HF dir, hub name, .gguf);
    a model not in the map uses `default_source` (None = the default SmolLM2 GGUF).
    """

    def __init__(self, tokenizers: Mapping[str, str] | None = None,
                 default_source: str | None = None,
                 loader: Callable[[str | None], _Tokenizer] | None = None) -> None:
        self.sources = dict(tokenizers or {})
        self.default_source = default_source
        self.loader = loader
        self.estimated = False
        self._cache: dict[str | None, _Tokenizer | None] = {}
        self._lock = threading.Lock()

    def is_ready(self, model: str | None) -> bool:
        """True once this model's tokenizer is loaded (counting is then cheap)."""
        return self.sources.get(model or "", self.default_source) in self._cache

    def tokenizer(self, model: str | None) -> _Tokenizer | None:
        source = self.sources.get(model or "", self.default_source)
        with self._lock:
            if source not in self._cache:
                self._cache[source] = self._load(source)
            return self._cache[source]

    def _load(self, source: str | None) -> _Tokenizer | None:
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
        tok = self.tokenizer(model)
        messages = chat_messages(body)
        if messages is not None:
            if tok is None:
                return _estimate("".join(m["content"] for m in messages))
            return len(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))
        return sum(self._count_one(tok, item) for item in _raw_inputs(body))

    @staticmethod
    def _count_one(tok: _Tokenizer | None, item: Any) -> int:
        if isinstance(item, list):
            return len(item)
        text = str(item)
        return _estimate(text) if tok is None else len(tok.encode(text))


def _estimate(text: str) -> int:
    return (len(text) + 3) // 4


def estimate_prompt_tokens(model: str | None, body: dict[str, Any]) -> int:
    """chars/4 for every input: the counter to inject where no tokenizer is wanted."""
    messages = chat_messages(body)
    if messages is not None:
        return _estimate("".join(m["content"] for m in messages))
    return sum(len(i) if isinstance(i, list) else _estimate(str(i)) for i in _raw_inputs(body))
