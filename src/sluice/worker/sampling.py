"""From an OpenAI request to the engine's inputs: SamplingParams and prompt token ids."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import ChatMessage, SamplingFields

if TYPE_CHECKING:
    from sluice.engine.tokenizer import Tokenizer

# Request fields copied to SamplingParams only when the client set them.
OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed")


def sampling_params(req: SamplingFields, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams (DELTA outputs); raises InvalidRequestError naming a field."""
    options: dict[str, Any] = {name: getattr(req, name) for name in OPTIONAL_FIELDS
                               if getattr(req, name) is not None}
    return SamplingParams(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA, **options)


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage],
                add_generation_prompt: bool = True) -> str:
    """The model's chat template applied to `messages`; a template error is a 400."""
    try:
        return tokenizer.apply_chat_template([m.as_template_dict() for m in messages],
                                             add_generation_prompt=add_generation_prompt)
    except InvalidRequestError:
        raise
    except Exception as exc:  # jinja2 errors raised by the model's own template
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is out of range [0, {vocab_size})",
                                  param=param)
    return ids
