"""vLLM's PoolingParams: what one pooling request (an embedding, a classification, a
score) asks beyond its prompt. No torch: the front end's `InputProcessor` reads it."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.sampling_params import TRUNCATION_RULE, truncation_ok
from sluice.protocol.errors import InvalidRequestError

POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
TOKEN_LEVEL = "ALL"  # a token task's pooling type (`CoreRequest.pooling_type`): every row


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams: one pooling request's own settings (`LLM.embed`,
    `LLM.classify`, `LLM.score`; the worker's request fields of the same names).

    truncate_prompt_tokens  the prompt cut to its last this many tokens after tokenizing
                            (-1: to the context length; None: not cut)
    use_activation          the pooler's activation: an embedding L2-normalized, a
                            classifier's softmax or sigmoids; None: the model's default
                            (`Pooler.normalize`; a classifier's: on). Off, an embedding is
                            the raw pooled (and projected) vector, a classifier's scores
                            its raw logits.
    task                    vLLM's pooling task: `embed` (one vector), `classify` (a
                            classifier's label scores), `token_embed` / `token_classify`
                            (the same for every prompt token: ALL pooling, no Dense
                            projection); None: the model's (classify for a classifier,
                            else embed)
    """

    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if not truncation_ok(self.truncate_prompt_tokens):
            raise InvalidRequestError(f"truncate_prompt_tokens {TRUNCATION_RULE}, got "
                                      f"{self.truncate_prompt_tokens!r}",
                                      param="truncate_prompt_tokens")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got "
                                      f"{self.task!r}", param="task")
        if not isinstance(self.use_activation, bool | None):
            raise InvalidRequestError(f"use_activation must be True, False or None, got "
                                      f"{self.use_activation!r}", param="use_activation")

    @property
    def token_level(self) -> bool:
        """A token task: one answer a prompt token."""
        return self.task in ("token_embed", "token_classify")
