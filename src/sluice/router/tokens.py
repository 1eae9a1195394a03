"""The token ids the engine will see for a prompt, so prefix matching is on real tokens.

Character matching (SGLang's radix tree on text) drifts from what the engine caches: a
chat template adds tokens, and equal text prefixes need not tokenize equally at the
boundary. The router therefore hashes token blocks of the *templated, tokenized* prompt,
obtained from:

1. a local tokenizer (`sluice.engine.tokenizer.load_tokenizer`, torch-free) when the pool
   names one: no round trip;
2. otherwise the worker's `/tokenize` (vLLM's shape; `messages` for chat); a worker
   whose /tokenize fails or is missing is not asked again for a minute.

Results (and their block hashes) are cached (LRU by prompt), so a repeated prompt costs
one dictionary lookup. A failure yields None and the request is routed on load alone.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from sluice.protocol.block_hash import hash_blocks
from sluice.router.parse import ParsedRequest

log = logging.getLogger(__name__)

UNSUPPORTED_RETRY_S = 60.0


class LocalTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


def load_local_tokenizer(model: str) -> LocalTokenizer:
    from sluice.engine.tokenizer import load_tokenizer

    return load_tokenizer(model)


@dataclass
class PromptTokens:
    """A prompt's token ids and, computed once per block size, their block hashes."""

    ids: list[int]
    _hashes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        hashes = self._hashes.get(block_size)
        if hashes is None:
            hashes = self._hashes[block_size] = tuple(hash_blocks(self.ids, block_size))
        return hashes


CacheKey = tuple[str, tuple[tuple[str, str], ...] | None, str | None]


def _cache_key(model: str, req: ParsedRequest) -> CacheKey:
    """The prompt as a tuple of strings: hashing it is a C loop over cached string
    hashes, several times cheaper than serializing and digesting it per request."""
    messages = (None if req.messages is None
                else tuple((m["role"], m["content"]) for m in req.messages))
    return (model, messages, req.prompt)


class PromptTokenizer:
    """Token ids for prompts; one per router, shared by its pools."""

    def __init__(self, client: httpx.AsyncClient, cache_size: int = 4096) -> None:
        self.client = client
        self.cache_size = cache_size
        self._cache: OrderedDict[CacheKey, PromptTokens] = OrderedDict()
        self._unsupported: dict[str, float] = {}  # worker url -> retry /tokenize after
        self.hits = 0
        self.misses = 0

    async def tokens(self, req: ParsedRequest, model: str, local: LocalTokenizer | None,
                     worker_url: str | None) -> PromptTokens | None:
        """Token ids of `req`'s prompt, or None if they cannot be had."""
        if req.prompt_ids is not None:
            return PromptTokens(req.prompt_ids)
        if req.messages is None and req.prompt is None:
            return None
        key = _cache_key(model, req)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return cached
        self.misses += 1
        ids = self._local(req, local)
        if ids is None and worker_url is not None:
            ids = await self._remote(req, model, worker_url)
        if ids is None:
            return None
        prompt = self._cache[key] = PromptTokens(ids)
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return prompt

    @staticmethod
    def _local(req: ParsedRequest, tok: LocalTokenizer | None) -> list[int] | None:
        if tok is None:
            return None
        if req.messages is not None:
            text = tok.apply_chat_template(list(req.messages), add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(req.prompt or "", add_special_tokens=True)

    async def _remote(self, req: ParsedRequest, model: str, url: str) -> list[int] | None:
        body: dict[str, Any] = {"model": model}
        if req.messages is not None:
            body.update(messages=req.messages, add_generation_prompt=True)
        else:
            body["prompt"] = req.prompt
        if self._unsupported.get(url, 0.0) > time.monotonic():
            return None
        try:
            resp = await self.client.post(f"{url}/tokenize", json=body)
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
