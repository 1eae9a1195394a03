"""The model's sampling defaults, from its Hugging Face `generation_config.json`.

A checkpoint's creator can recommend sampling settings there (Qwen2.5: temperature 0.7,
top_p 0.8, top_k 20, repetition_penalty 1.05). vLLM (`--generation-config auto`, its
default since 0.7) uses them as the defaults of requests that do not set them, and so
does sluice, with the same setting (`ModelConfig.generation_config`):

    "auto"   the model's own file: a checkpoint directory's, a hub model's (just that
             file is fetched); a GGUF file has none
    "vllm"   none: the engine's own defaults (SamplingParams())
    PATH     generation_config.json of that folder (missing: an error)

Only vLLM's keys are read: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` (the default `max_tokens`); others
(`do_sample`, `eos_token_id`, ...) are not sampling defaults here, as in vLLM. A value of
the wrong type or out of range is an `InvalidRequestError` naming the file and the key,
raised at startup rather than on every request. A request's own values always win.
The worker applies `max_tokens` where a request has none: a chat request that leaves it
out, a completion that sends null (OpenAI's completions default it to 16, as vLLM
keeps), up to what the context leaves (sluice.worker.generation.default_max_tokens).

No torch here: the worker's front process reads it before the engine starts.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sluice.engine.sampling_params import SamplingParams, is_integer
from sluice.engine.tokenizer import ModelNotFoundError, is_hub_id, resolve_model
from sluice.protocol.errors import InvalidRequestError

if TYPE_CHECKING:
    from sluice.engine.config import ModelConfig

FILE_NAME = "generation_config.json"

# the file's key -> SamplingParams' field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_INT_KEYS = ("top_k", "max_new_tokens")


def generation_defaults(model: str | None, setting: str = "auto",
                        revision: str | None = None) -> dict[str, Any]:
    """The sampling defaults `setting` gives for `model`, by SamplingParams' field names
    (`max_new_tokens` as `max_tokens`): only the keys the file sets; {} for none."""
    file = generation_config_file(model, setting, revision)
    return read_generation_defaults(file) if file is not None else {}


def model_defaults(model: ModelConfig) -> dict[str, Any]:
    """`generation_defaults` of an engine's model and its `generation_config` setting."""
    return generation_defaults(model.model, model.generation_config, model.revision)


def generation_config_file(model: str | None, setting: str = "auto",
                           revision: str | None = None) -> Path | None:
    """The generation_config.json `setting` points at (None: no defaults to read)."""
    if setting == "vllm" or (setting == "auto" and model is None):  # None: the GGUF
        return None
    if setting != "auto":
        folder = Path(setting).expanduser()
        if not (folder / FILE_NAME).is_file():
            raise InvalidRequestError(f"generation_config {setting!r}: no {FILE_NAME} in "
                                      "that folder (or give 'auto' or 'vllm')",
                                      param="generation_config")
        return folder / FILE_NAME
    resolved = resolve_model(model)
    path = Path(resolved).expanduser()
    if path.is_dir():
        return path / FILE_NAME if (path / FILE_NAME).is_file() else None
    if path.exists() or not is_hub_id(resolved):  # a GGUF file; a missing one is the loader's
        return None
    return _hub_file(resolved, revision)


def _hub_file(repo_id: str, revision: str | None) -> Path | None:  # pragma: no cover - network
    """A hub model's generation_config.json alone (None: it has none); the weights are
    the engine core's to fetch."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, FILE_NAME, revision=revision))
    except EntryNotFoundError:
        return None
    except Exception as exc:
        raise ModelNotFoundError(f"model {repo_id!r}: its {FILE_NAME} could not be fetched "
                                 f"from the Hugging Face hub: {exc}", param="model") from exc


def read_generation_defaults(file: Path) -> dict[str, Any]:
    """vLLM's keys of one generation_config.json, checked as SamplingParams checks a
    request; raises InvalidRequestError naming the file and the key."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{file}: cannot read it as JSON: {exc}",
                                  param="generation_config") from None
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{file}: must be a JSON object", param="generation_config")
    defaults: dict[str, Any] = {KEYS[key]: _typed(file, key, value) for key, value in data.items()
                if key in KEYS and value is not None}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        key = next((k for k, name in KEYS.items() if name == exc.param), exc.param)
        reason = exc.message.removeprefix(f"{exc.param} ")
        raise InvalidRequestError(f"{file}: {key} {reason}", param="generation_config") from None
    if defaults.get("top_k") == 0:  # HF's and SamplingParams' "disabled"
        defaults["top_k"] = -1
    return defaults


def _typed(file: Path, key: str, value: Any) -> int | float:
    """`value` as the key's type; a bool, a string or 4.0 for an integer is an error."""
    if key in _INT_KEYS:
        if not is_integer(value):
            raise InvalidRequestError(f"{file}: {key} must be an integer, got {value!r}",
                                      param="generation_config")
        return int(value)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise InvalidRequestError(f"{file}: {key} must be a number, got {value!r}",
                                  param="generation_config")
    return float(value)


def overridden_warning(defaults: dict[str, Any], relaunch: str) -> str:
    """The line logged once at startup when the model's defaults apply (`relaunch`: how
    to turn them off, e.g. `--generation-config vllm`)."""
    values = ", ".join(f"{name}={value!r}" for name, value in defaults.items())
    return (f"Default sampling parameters have been overridden by the model's generation "
            f"config ({values}); a request's own values still win. If this is not "
            f"intended, relaunch with {relaunch}.")
