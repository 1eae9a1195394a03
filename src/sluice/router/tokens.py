"""The token ids the engine will see for a prompt, so prefix matching is on real tokens.

Character matching (SGLang's radix tree on text) drifts from what the engine caches: a
chat template adds tokens, and equal text prefixes need not tokenize equally at the
boundary. The router therefore hashes token blocks of the *templated, tokenized* prompt
(the one prompt view, `sluice.protocol.prompt`), obtained from, in order:

1. the ids the previous hop already computed (`x-sluice-prompt-ids`, from the gateway)
   when they come from the pool's own tokenizer (same fingerprint): no work at all;
2. a local tokenizer (`sluice.engine.tokenizer.load_tokenizer`, torch-free) when the pool
   names one, through the process's `TokenCache`; the ids then go on to the worker in
   the same header, so the worker does not tokenize again;
3. otherwise the worker's `/tokenize` (vLLM's shape; `messages` for chat); a worker
   whose /tokenize fails or is missing is not asked again for a minute; one that has
   not answered within the probes' timeout (a hung worker) leaves the request routed
   without its tokens.

Repeated prompts cost one dictionary lookup. A failure yields None and the request is
routed on load alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx

from sluice.protocol.prompt import (
    INLINE_TOKENIZE_CHARS,
    IdsHint,
    PromptTokens,
    PromptView,
    TokenCache,
    cache_key,
    fingerprint,
    kept,
    make_hint,
)
from sluice.protocol.prompt import Tokenizer as LocalTokenizer
from sluice.router.parse import ParsedRequest

log = logging.getLogger(__name__)

UNSUPPORTED_RETRY_S = 60.0


def load_local_tokenizer(model: str) -> LocalTokenizer:
    from sluice.engine.tokenizer import load_tokenizer

    return load_tokenizer(model)


RemoteKey = tuple[str, tuple[tuple[str, str], ...] | None, str | None]


def _remote_key(model: str, view: PromptView) -> RemoteKey:
    """The prompt as a tuple of strings: hashing it is a C loop over cached string
    hashes, several times cheaper than serializing and digesting it per request."""
    messages = (None if view.messages is None
                else tuple((m["role"], m["content"]) for m in view.messages))
    text = view.texts[0] if view.texts and isinstance(view.texts[0], str) else None
    return (model, messages, text)


@dataclass(frozen=True)
class Tokenized:
    """A prompt's tokens and the hint that passes them to the next hop (if any)."""

    tokens: PromptTokens
    hint: IdsHint | None = None


class PromptTokenizer:
    """Token ids for prompts; one per router, shared by its pools."""

    def __init__(self, client: httpx.AsyncClient, cache: TokenCache,
                 timeout_s: float = 2.0) -> None:
        """`timeout_s`: how long a worker's /tokenize may take before the request is
        routed without its tokens (a hung worker held every request asking it)."""
        self.client = client
        self.cache = cache
        self.timeout = httpx.Timeout(timeout_s)
        self._remote_cache: OrderedDict[RemoteKey, PromptTokens] = OrderedDict()
        self._unsupported: dict[str, float] = {}  # worker url -> retry /tokenize after
        self._fingerprints: dict[int, str] = {}  # id(local tokenizer) -> fingerprint

    def fingerprint(self, tok: LocalTokenizer) -> str:
        fp = self._fingerprints.get(id(tok))
        if fp is None:
            fp = self._fingerprints[id(tok)] = fingerprint(tok)
        return fp

    async def tokens(self, req: ParsedRequest, model: str, local: LocalTokenizer | None,
                     worker_url: str | None, hint: IdsHint | None = None) -> Tokenized | None:
        """Token ids of `req`'s prompt as the engine reads them (its last
        `truncate_prompt_tokens`: `kept`), or None if they cannot be had; the hint still
        passes the whole prompt's ids (the worker cuts them the same way)."""
        found = await self._tokens(req, model, local, worker_url, hint)
        if found is None or req.view is None:
            return found
        ids = kept(found.tokens.ids, req.view)
        if len(ids) == len(found.tokens.ids):
            return found  # (its cached block hashes kept)
        return Tokenized(PromptTokens(ids), found.hint)

    async def _tokens(self, req: ParsedRequest, model: str, local: LocalTokenizer | None,
                      worker_url: str | None, hint: IdsHint | None) -> Tokenized | None:
        view = req.view
        if view is None:
            return None
        if req.prompt_ids is not None:
            return Tokenized(PromptTokens(req.prompt_ids))
        if view.messages is None and len(view.texts) != 1:
            return None
        if local is not None:
            fp = self.fingerprint(local)
            if hint is not None and hint.fingerprint == fp:
                return Tokenized(PromptTokens(hint.ids), hint)  # the gateway's, verbatim
            if view.chars <= INLINE_TOKENIZE_CHARS:
                return self._local(local, fp, model, view)
            return await asyncio.to_thread(self._local, local, fp, model, view)
        if worker_url is None:
            return None
        key = _remote_key(model, view)
        cached = self._remote_cache.get(key)
        if cached is None:
            ids = await self._remote(view, model, worker_url)
            if ids is None:
                return None
            cached = self._remote_cache[key] = PromptTokens(ids)
            if len(self._remote_cache) > self.cache.size:
                self._remote_cache.popitem(last=False)
        return Tokenized(cached)

    def _local(self, tok: LocalTokenizer, fp: str, model: str, view: PromptView) -> Tokenized:
        if view.messages is not None:
            text, special = self.cache.chat_text(tok, model, view), False
        else:
            text, special = str(view.texts[0]), True
        tokens = self.cache.tokens(tok, model, text, special=special)
        return Tokenized(tokens, make_hint(fp, cache_key(text, special), tokens.ids))

    async def _remote(self, view: PromptView, model: str, url: str) -> list[int] | None:
        body: dict[str, Any] = {"model": model}
        if view.messages is not None:
            body.update(messages=view.messages, add_generation_prompt=True)
        else:
            body["prompt"] = view.texts[0]
        if self._unsupported.get(url, 0.0) > time.monotonic():
            return None
        try:
            resp = await self.client.post(f"{url}/tokenize", json=body, timeout=self.timeout)
            tokens = resp.json().get("tokens") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            log.debug("tokenize via %s failed: %s", url, exc)
            return None
        if not isinstance(tokens, list):
            # no usable /tokenize there: stop paying a round trip per request for a while
            log.info("%s has no usable /tokenize (status %s); routing without tokens for %ss",
                     url, resp.status_code, UNSUPPORTED_RETRY_S)
            self._unsupported[url] = time.monotonic() + UNSUPPORTED_RETRY_S
            return None
        return list(tokens)
