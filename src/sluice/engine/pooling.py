"""How an embedding is read from a prompt's final hidden states (vLLM's pooler config).

    LAST   the last token's state (decoder-only embedding models: Qwen3-Embedding,
           e5-mistral, gte-Qwen2; the default)
    MEAN   the mean over every prompt token's state (sentence-transformers models with
           `pooling_mode_mean_tokens`; attention stays causal in a decoder)
    CLS    the first token's state (`pooling_mode_cls_token`)

and whether the vector is L2-normalized. A checkpoint directory's sentence-transformers
files (`modules.json` naming a Pooling module, its `config.json`, Dense modules after it,
and a Normalize module or not) give the model's own choice, as vLLM reads them: each
Dense module (a linear, with or without a bias, then identity or tanh: LaBSE's
projection) maps the pooled vector before it is normalized; `--pooler-config`
(vLLM's flag: `pooling_type`, `use_activation` or its older name `normalize`) replaces
the fields it names. Without either: LAST, normalized.

MEAN and CLS need states that a prefix-cache hit would skip, so such a request computes
its whole prompt (`Sequence.computes_whole_prompt`); its blocks are still cached for
others. A long prompt is still chunked: MEAN sums each chunk's rows and divides once at
the end, CLS keeps the first chunk's first row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sluice.engine.pooling_params import TOKEN_LEVEL
from sluice.protocol.errors import InvalidRequestError

POOLING_TYPES = ("LAST", "MEAN", "CLS")

# sentence-transformers' Pooling config keys -> our type (the modes it can combine, such
# as max or weighted mean, or several at once, are refused)
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


# sentence-transformers' Dense activations -> the function applied after the linear
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": None,
                      "torch.nn.modules.activation.Tanh": torch.tanh}


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers Dense module: activation(x @ weight.T + bias)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.linear(x, self.weight, self.bias)
        act = _DENSE_ACTIVATIONS[self.activation]
        return x if act is None else act(x)


@dataclass(frozen=True)
class Pooler:
    pooling_type: str = "LAST"
    normalize: bool = True
    # the checkpoint's Dense modules after pooling, in order (float32; not compared)
    dense: tuple[Dense, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(f"unsupported pooling_type {self.pooling_type!r} "
                                      f"(supported: {', '.join(POOLING_TYPES)})",
                                      param="pooler_config")

    def resolve(self, flag: dict[str, Any]) -> Pooler:
        """This (the model's own) with `--pooler-config`'s fields replacing its own."""
        return Pooler(flag.get("pooling_type", self.pooling_type),
                      flag.get("normalize", self.normalize), self.dense)

    def project(self, pooled: torch.Tensor) -> torch.Tensor:
        """The pooled rows through the Dense modules (unchanged without any)."""
        for layer in self.dense:
            pooled = layer(pooled)
        return pooled

    def width(self, hidden_size: int) -> int:
        """An embedding's length: the last Dense module's outputs, else the model's."""
        return int(self.dense[-1].weight.shape[0]) if self.dense else hidden_size


def parse_pooler_config(text: str | None) -> dict[str, Any]:
    """`--pooler-config`'s JSON as the Pooler fields it sets; a 400 naming
    `pooler_config` for unknown keys, types or values."""
    from sluice.engine.config import json_object

    if text is None:
        return {}
    raw = json_object(text, "pooler_config")
    unknown = sorted(set(raw) - {"pooling_type", "normalize", "use_activation"})
    if unknown:
        raise InvalidRequestError(f"pooler_config: unsupported field(s) {unknown} (supported: "
                                  "pooling_type, use_activation, normalize)",
                                  param="pooler_config")
    out: dict[str, Any] = {}
    if "pooling_type" in raw:
        kind = raw["pooling_type"]
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise InvalidRequestError(f"pooler_config: pooling_type must be one of "
                                      f"{', '.join(POOLING_TYPES)}, not {kind!r}",
                                      param="pooler_config")
        out["pooling_type"] = kind.upper()
    given = {k: raw[k] for k in ("use_activation", "normalize") if k in raw}
    for key, value in given.items():
        if not isinstance(value, bool):
            raise InvalidRequestError(f"pooler_config: {key} must be true or false",
                                      param="pooler_config")
    if len(set(given.values())) > 1:
        raise InvalidRequestError("pooler_config: use_activation and normalize disagree "
                                  "(normalize is use_activation's older name)",
                                  param="pooler_config")
    if given:
        out["normalize"] = next(iter(given.values()))
    return out


def resolve_pooler(directory: Path | None, flag: dict[str, Any],
                   default: Pooler = Pooler()) -> Pooler:
    """The pooler an engine runs: the model's own (a checkpoint `directory`'s
    sentence-transformers files; `default` without them: LAST, normalized, for a decoder)
    with `flag`'s fields (`parse_pooler_config`) over it. A model whose own pooling sluice
    lacks (max, or several modes at once) is refused unless the flag chooses the type."""
    try:
        own = sentence_transformers_pooler(directory) if directory is not None else None
    except InvalidRequestError:
        if "pooling_type" not in flag:
            raise
        own = None
    return (own or default).resolve(flag)


def sentence_transformers_pooler(directory: Path) -> Pooler | None:
    """The pooling a checkpoint's sentence-transformers files declare, or None where it
    has none (no `modules.json`, or no Pooling module in it)."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise InvalidRequestError(f"{modules_file}: expected a list of modules", param="model")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules
             if isinstance(m, dict)}
    pooling = kinds.get("Pooling")
    if pooling is None:
        return None
    config_file = directory / str(pooling.get("path", "")) / "config.json"
    if not config_file.is_file():
        raise InvalidRequestError(f"{directory}: modules.json names a Pooling module whose "
                                  f"{config_file.relative_to(directory)} is missing",
                                  param="model")
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise InvalidRequestError(f"{config_file}: expected a JSON object", param="model")
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    other = [key for key in _ST_OTHER_MODES if config.get(key)]
    if other or len(chosen) != 1:
        raise InvalidRequestError(
            f"{config_file}: sentence-transformers pooling "
            f"{sorted(k for k in (*_ST_MODES, *_ST_OTHER_MODES) if config.get(k))} is not "
            "supported (one of pooling_mode_lasttoken, pooling_mode_mean_tokens, "
            "pooling_mode_cls_token); --pooler-config chooses another", param="model")
    dense = tuple(_dense(directory, m) for m in modules
                  if isinstance(m, dict) and str(m.get("type", "")).endswith(".Dense"))
    return Pooler(chosen[0], normalize="Normalize" in kinds, dense=dense)


def _dense(directory: Path, module: dict[str, Any]) -> Dense:
    """One Dense module: its `config.json` and `model.safetensors` (or
    `pytorch_model.bin`, read with weights_only)."""
    folder = directory / str(module.get("path", ""))
    config = _read_json(folder / "config.json")
    activation = config.get("activation_function", "torch.nn.modules.linear.Identity")
    if activation not in _DENSE_ACTIVATIONS:
        raise InvalidRequestError(f"{folder}: Dense activation {activation!r} is not supported "
                                  f"({', '.join(_DENSE_ACTIVATIONS)})", param="model")
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        tensors = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise InvalidRequestError(f"{folder}: a Dense module without model.safetensors or "
                                  "pytorch_model.bin", param="model")
    if "linear.weight" not in tensors:
        raise InvalidRequestError(f"{folder}: no tensor 'linear.weight'", param="model")
    bias = tensors.get("linear.bias")
    return Dense(tensors["linear.weight"].float(), None if bias is None else bias.float(),
                 activation)


def _read_json(file: Path) -> Any:
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"{file}: {exc}", param="model") from None


def label_scores(logits: torch.Tensor, multi_label: bool) -> torch.Tensor:
    """A classifier's scores from its logits (rows of inputs), float32: each label's
    sigmoid (one label: a cross-encoder's score; or a multi-label model's), else a
    softmax over the labels (transformers' and vLLM's rule)."""
    logits = logits.float()
    if logits.shape[-1] == 1 or multi_label:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def pooled_rows(spans: Iterable[tuple[int, int, str]]) -> tuple[list[int], list[int]]:
    """For pooling chunks whose tokens are rows `first .. first + n - 1` of a step's
    states, each `(first, n, pooling type)`: the rows the types read (MEAN and ALL every
    one, CLS the first, LAST the last), in chunk order, and how many each chunk has
    (`chunk_rows`'s sizes)."""
    rows: list[int] = []
    sizes: list[int] = []
    for first, n, kind in spans:
        span = range(first, first + n) if kind in ("MEAN", TOKEN_LEVEL) else \
            range(first, first + 1) if kind == "CLS" else range(first + n - 1, first + n)
        rows.extend(span)
        sizes.append(len(span))
    return rows, sizes


def chunk_rows(states: torch.Tensor, sizes: list[int], kinds: list[str]) -> list[torch.Tensor]:
    """What each chunk keeps of its `sizes` consecutive rows of `states`: every row (an
    (n, width) block) under ALL, else their sum (one row; the row itself where it has
    one)."""
    if len(sizes) == states.shape[0] and TOKEN_LEVEL not in kinds:
        return list(states.unbind(0))
    return [part if kind == TOKEN_LEVEL else part.sum(0)
            for part, kind in zip(states.split(sizes), kinds, strict=True)]


def unit_rows(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a cosine is then a dot product; a pooler may leave its
    vectors unnormalized)."""
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
