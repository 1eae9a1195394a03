"""Engine logprobs ({token_id: logprob} per position) in OpenAI's two shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
each `top_logprobs` the sampled token and the `logprobs` likeliest (up to `logprobs` + 1).
Prompt logprobs (vLLM's `prompt_logprobs`, and completions' `echo` with `logprobs`): the
first in completions' shape, vLLM's `[null, {"<id>": {"logprob", "rank", "decoded_token"}}]`.
Token strings are the decoded text of each token (as OpenAI and vLLM show them), `bytes`
the token's own bytes (a piece of a multi-byte character is U+FFFD as text, its real
bytes here, so the pieces join), and -inf becomes -9999.0 because JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sluice.engine.outputs import TokenLogprobs
from sluice.protocol.openai import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from sluice.engine.tokenizer import Tokenizer

FLOOR = -9999.0


def _finite(value: float) -> float:
    return FLOOR if math.isinf(value) or math.isnan(value) else max(value, FLOOR)


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def _text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                  entries: Sequence[TokenLogprobs], k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = _text(tokenizer, token_id)
        top = [TopLogprob(token=_text(tokenizer, i), logprob=_finite(lp),
                          bytes=list(tokenizer.token_bytes(i)))
               for i, lp in _top(entry, k)]
        content.append(TokenLogprob(token=text, logprob=_finite(entry.get(token_id, -math.inf)),
                                    bytes=list(tokenizer.token_bytes(token_id)),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                        entries: Sequence[TokenLogprobs | None], k: int,
                        offset: int) -> CompletionLogprobs:
    """Completion logprobs; `offset` is where the first token's text starts in the choice.
    Each `top_logprobs` holds the sampled token and the `k` likeliest (up to k + 1, as
    OpenAI documents and vLLM answers: the sampled one first). An echoed prompt's first
    token has no entry (None): its logprob and top are null, as OpenAI's."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = _text(tokenizer, token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_finite(entry.get(token_id, -math.inf)))
        top = {text: _finite(entry.get(token_id, -math.inf))}  # the sampled one wins a
        for i, lp in _top(entry, k):  # text another token also decodes to
            top.setdefault(_text(tokenizer, i), _finite(lp))
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs | None], k: int
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token, None for the first, else token id
    (a string, as JSON keys are) -> {logprob, rank, decoded_token} for the prompt's own
    token and the `k` likeliest; rank 1 is the likeliest, null for a prompt token outside
    the top `k` (sluice ranks only those)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        rank = {t: i + 1 for i, (t, _) in enumerate(_top(entry, k))}
        out.append({str(t): {"logprob": _finite(lp), "rank": rank.get(t),
                             "decoded_token": _text(tokenizer, t)} for t, lp in entry.items()})
    return out
