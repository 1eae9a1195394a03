"""The offline API, shaped like vLLM's `LLM`: give it prompts, get finished outputs.

    llm = LLM(max_num_seqs=64)                       # None: the default SmolLM2 GGUF
    outs = llm.generate(["Hello", "Hi"], SamplingParams(temperature=0, max_tokens=32))
    outs[0].outputs[0].text

All prompts are queued at once and the engine is stepped until every one finishes, so
they share batches (continuous batching); results come back in prompt order.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.llm_engine import LLMEngine
from sluice.engine.lora import LoRARequest
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.protocol.errors import InvalidRequestError

# vLLM's prompt shapes: text, token ids, or a dict (`TextPrompt` {"prompt": ...},
# `TokensPrompt` {"prompt_token_ids": [...]}); one or a list of them
Prompt = str | list[int] | dict[str, Any]
Prompts = Prompt | Sequence[Prompt]
ParamsArg = SamplingParams | Sequence[SamplingParams] | None
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


class LLM:
    """One engine driven synchronously in the caller's thread."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model, **engine_options)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompts, sampling_params: ParamsArg = None,
                 use_tqdm: bool = False, lora_request: LoRAArg = None) -> list[RequestOutput]:
        """Run every prompt to completion; one output per prompt, in order.
        `lora_request`: one adapter for all prompts, or one (or None) per prompt."""
        items = _normalize_prompts(prompts)
        params = _normalize_params(sampling_params, len(items))
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(items)
        else:
            loras = list(lora_request)
            if len(loras) != len(items):
                raise ValueError(f"got {len(loras)} lora_requests for {len(items)} prompts")
        ids = self._add_all(items, params, loras)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: ParamsArg = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(list(c), add_generation_prompt=True),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params)

    def _add_all(self, prompts: list[str | list[int]], params: list[SamplingParams],
                 loras: list[LoRARequest | None] | None = None) -> list[str]:
        ids: list[str] = []
        loras = loras or [None] * len(prompts)
        try:
            for prompt, p, lora in zip(prompts, params, loras, strict=True):
                request_id = f"llm-{next(self._ids)}"
                final = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, prompt, final, lora_request=lora)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _normalize_prompts(prompts: Prompts) -> list[str | list[int]]:
    if isinstance(prompts, str | dict):
        return [_prompt(prompts)]
    items: list[Any] = list(prompts)
    if items and isinstance(items[0], int):  # a single prompt given as token ids
        return [_prompt(items)]
    return [_prompt(p) for p in items]


def _prompt(prompt: Prompt) -> str | list[int]:
    """Text or token ids from one of vLLM's prompt shapes; an unsupported one (a dict
    with other keys, e.g. `multi_modal_data`) is an `InvalidRequestError` naming it."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    extra = sorted(keys - {"prompt", "prompt_token_ids"})
    raise InvalidRequestError(
        f"unsupported prompt key {extra[0]!r}" if extra else
        "a prompt dict takes one of 'prompt' (a string) or 'prompt_token_ids' (a list of "
        "token ids)", param="prompt")


def _normalize_params(params: ParamsArg, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return list(params)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts")
