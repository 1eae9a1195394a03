"""From an OpenAI request to the engine's inputs: SamplingParams and prompt token ids."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sluice.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from sluice.protocol.errors import InvalidRequestError
from sluice.protocol.openai import ChatMessage, SamplingFields
from sluice.protocol.prompt import PromptView, check_template_kwargs, templated

if TYPE_CHECKING:
    from sluice.engine.tokenizer import Tokenizer

# Request fields copied to SamplingParams only when the client set them.
OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed")


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    vocab_size: int, tool_constraint: StructuredOutputsParams | None = None,
                    defaults: Mapping[str, Any] | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The engine's SamplingParams (DELTA outputs); raises InvalidRequestError naming a field.
    `vocab_size`: the tokenizer's (stop token ids must be in it). `tool_constraint`: the
    grammar that forces a tool call (tool_choice required/named). `defaults`: the model's
    (WorkerConfig.generation_defaults) for the OPTIONAL_FIELDS the client left out; their
    `max_tokens` is not applied here but per prompt, capped by the context
    (`generation.default_max_tokens`). `prompt_logprobs`: the request's, or what its
    `echo` with `logprobs` asks for (completions)."""
    req.check_stream_options()
    req.check_prompt_logprobs()
    options: dict[str, Any] = {name: value for name, value in (defaults or {}).items()
                               if name in OPTIONAL_FIELDS}
    options |= {name: getattr(req, name) for name in OPTIONAL_FIELDS
                if getattr(req, name) is not None}
    stop_ids = check_token_ids(list(req.stop_token_ids or []), vocab_size, "stop_token_ids")
    bias = req.logit_bias_ids()
    check_token_ids(list(bias or {}), vocab_size, "logit_bias")
    return SamplingParams(
        structured_outputs=structured_outputs(req, tool_constraint),
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_list(),
        stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        thinking_token_budget=req.thinking_token_budget,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=RequestOutputKind.DELTA, logit_bias=bias, **options)


def structured_outputs(req: SamplingFields, tool_constraint: StructuredOutputsParams | None
                       ) -> StructuredOutputsParams | None:
    """The one output constraint of a request: `response_format` (OpenAI), vLLM's
    `structured_outputs`, or a forced tool call; two at once is a 400."""
    found = [c for c in (_response_format(req), _vllm_structured(req), tool_constraint)
             if c is not None]
    if len(found) > 1:
        raise InvalidRequestError(f"{found[0].param} and {found[1].param} cannot be combined: "
                                  "a request takes one output constraint", param=found[1].param)
    return found[0] if found else None


def _response_format(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "structural_tag":
        return StructuredOutputsParams(structural_tag=fmt.structural_tag(),
                                       param="response_format")
    if fmt.type == "json_object" or (fmt.json_schema is not None
                                     and fmt.json_schema.schema_ is None):
        return StructuredOutputsParams(json_object=True, param="response_format")
    if fmt.json_schema is None:
        raise InvalidRequestError("response_format of type json_schema needs json_schema",
                                  param="response_format.json_schema")
    return StructuredOutputsParams.from_schema(fmt.json_schema.schema_, "response_format")


def _vllm_structured(req: SamplingFields) -> StructuredOutputsParams | None:
    so = req.structured_outputs
    if so is None:
        return None
    param = "structured_outputs"
    schema = so.json_  # a parsed schema becomes the same JSON text a string one is
    if isinstance(schema, dict):
        schema = StructuredOutputsParams.from_schema(schema, param).json
    return StructuredOutputsParams(json=schema, regex=so.regex, choice=tuple(so.choice)
                                   if so.choice is not None else None, grammar=so.grammar,
                                   json_object=bool(so.json_object),
                                   structural_tag=so.structural_tag, param=param)


def chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage],
                add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The model's chat template applied to `messages` (and `tools`, and the request's
    `chat_template_kwargs`), cut after the last message's content to continue it
    (`protocol.prompt.continue_final`); a template error is a 400."""
    turns = [m.as_template_dict(f"messages.{i}") for i, m in enumerate(messages)]
    return templated(tokenizer, PromptView(
        messages=turns, tools=tools, continue_final=continue_final_message,
        generation_prompt=add_generation_prompt,
        template_kwargs=check_template_kwargs(template_kwargs)))


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is out of range [0, {vocab_size})",
                                  param=param)
    return ids
