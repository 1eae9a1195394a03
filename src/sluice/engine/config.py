"""Engine configuration: frozen dataclasses layered by concern, validated on construction.

`EngineConfig.from_options(**kw)` takes the flat keyword options users know from vLLM
(`LLM(model, max_num_seqs=..., block_size=...)`, `sluice worker --max-num-seqs ...`) and
files each under its layer. Unknown options are an error, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.sampling_params import seed_in_range
from sluice.protocol.errors import InvalidRequestError

KERNEL_BACKENDS = ("auto", "torch", "native")  # see sluice.engine.native
QUANTIZATIONS = ("none", "gguf", "int8")  # see sluice.engine.quant


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None  # defaults to the model's own
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA or a CPU with native bf16, else float32
    device: str = "auto"  # auto: cuda if available, else cpu
    max_model_len: int | None = None  # None: the model's own limit
    seed: int | None = 0  # of unseeded sampled requests' generator; None: a random one
    revision: str | None = None
    # CPU kernels (oneDNN linears, native attention, add+RMSNorm, SwiGLU): "auto" (when
    # they build), "torch", "native" (see sluice.engine.native)
    kernel_backend: str = "auto"
    # linears on the weights' own format: "none" (dense, the reference), "gguf" (a GGUF
    # file's Q4_0/Q4_1/Q8_0 blocks for decode rows), "int8" (weight-only int8, one scale
    # per output row, every linear; sluice.engine.quant)
    quantization: str = "none"
    # vLLM's name: True runs every step through the torch model; False lets decode steps
    # run as one native call where the model allows it (sluice.engine.decode_graph)
    enforce_eager: bool = False
    # threads for the CPU forward pass (torch.set_num_threads in the engine core); None:
    # torch's default, one per core. Engines sharing a host's cores should split them:
    # `sluice serve --workers N` does (sluice.serve.local_cpu_threads)
    cpu_threads: int | None = None
    # vLLM's name: where requests' sampling defaults come from: "auto" (the model's
    # generation_config.json), "vllm" (none: SamplingParams' own), or a folder holding a
    # generation_config.json (sluice.engine.generation_config; read by the front end)
    generation_config: str = "auto"
    # vLLM's name: a JSON object whose keys replace config.json's (a checkpoint directory's;
    # not a GGUF file's): '{"rope_scaling": {"rope_type": "yarn", ...}}' to serve Qwen2.5
    # past 32K as Qwen's model cards say, '{"is_matryoshka": true}' for `dimensions`
    hf_overrides: str | None = None
    # vLLM's name: how an embedding is read from the prompt's final hidden states, a JSON
    # object: '{"pooling_type": "MEAN", "use_activation": true}' (sluice.engine.pooling;
    # None: the model's sentence-transformers files say, else LAST, normalized)
    pooler_config: str | None = None

    def __post_init__(self) -> None:
        from sluice.engine.pooling import parse_pooler_config

        self.overrides()  # valid JSON, an object
        parse_pooler_config(self.pooler_config)
        if not self.generation_config:
            raise InvalidRequestError("generation_config must be 'auto', 'vllm' or a folder",
                                      param="generation_config")
        if not seed_in_range(self.seed):
            raise InvalidRequestError("seed must be in [-2**63, 2**64)", param="seed")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InvalidRequestError("cpu_threads must be at least 1", param="cpu_threads")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(f"unsupported quantization {self.quantization!r} "
                                      f"{QUANTIZATIONS}", param="quantization")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}", param="dtype")
        if re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device) is None:
            raise InvalidRequestError(f"unsupported device {self.device!r} (auto, cpu, cuda, "
                                      "cuda:N)", param="device")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise InvalidRequestError(f"unsupported kernel_backend {self.kernel_backend!r}"
                                      f" {KERNEL_BACKENDS}", param="kernel_backend")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be at least 1", param="max_model_len")

    def overrides(self) -> dict[str, Any]:
        """`hf_overrides` parsed: config.json's keys to replace (empty for none)."""
        return {} if self.hf_overrides is None else json_object(self.hf_overrides,
                                                                 "hf_overrides")


def json_object(text: str, param: str) -> dict[str, Any]:
    """A flag's JSON text as an object; a 400 naming `param` for anything else."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param} must be a JSON object", param=param)
    return value


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Size of the KV pool: explicit bytes win, then an explicit block count (tests),
    # else a fraction of free device memory (CUDA) or of total RAM (CPU).
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.1
    enable_prefix_caching: bool = True
    # Offload tiers below the pool ("host=4GiB,disk=DIR:20GiB") and a store shared by
    # workers ("redis://127.0.0.1:6379/0"); see sluice.engine.kv_offload.
    kv_offload: str | None = None
    kv_store: str | None = None

    def __post_init__(self) -> None:
        from sluice.engine.kv_offload import KVOffloadSpec, check_store_url

        if self.kv_offload is not None:
            KVOffloadSpec.parse(self.kv_offload)
        if self.kv_store is not None:
            check_store_url(self.kv_store)
        if (self.kv_offload or self.kv_store) and not self.enable_prefix_caching:
            raise InvalidRequestError("kv_offload and kv_store need prefix caching",
                                      param="kv_offload" if self.kv_offload else "kv_store")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a power of two", param="block_size")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be at least 1", param="num_kv_blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in (0, 1]",
                                      param="gpu_memory_utilization")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "priority"  # "fcfs" | "priority" (lower value runs first)
    # a directory: each engine core appends every step's chunks and seconds to
    # steps-<pid>.jsonl there (sluice.engine.step_log; `sluice sim calibrate --from-steps`)
    step_log: str | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be at least 1", param="max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be at least 1",
                                      param="max_num_batched_tokens")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise InvalidRequestError("scheduling_policy must be 'fcfs' or 'priority'",
                                      param="scheduling_policy")


# vLLM's names; auto: guidance where it can express the constraint, else xgrammar (see
# sluice.engine.structured_output and docs/engine.md for why)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
# The reasoning parsers (the worker's `--reasoning-parser`, sluice.worker.reasoning), and
# whether the output begins inside the thinking (the chat template opened it) or the
# model opens it with `<think>` itself.
REASONING_PARSERS = {"": False, "deepseek_r1": True, "qwen3": False}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    structured_outputs_backend: str = "auto"
    # A constraint still compiling after this long fails its request with a 400 (the
    # compile runs on a thread beside the step loop; other requests never wait for it).
    structured_outputs_compile_timeout: float = 10.0
    # A reasoning model's thinking (vLLM's StructuredOutputsConfig.reasoning_parser: the
    # worker's --reasoning-parser): a constrained output's grammar starts after
    # `</think>`, so the model thinks first (structured_output.Thinking). "": from the
    # first token.
    reasoning_parser: str = ""

    def __post_init__(self) -> None:
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise InvalidRequestError(
                f"unsupported structured_outputs_backend {self.structured_outputs_backend!r} "
                f"{STRUCTURED_OUTPUTS_BACKENDS}", param="structured_outputs_backend")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise InvalidRequestError(f"unknown reasoning_parser {self.reasoning_parser!r} "
                                      f"{tuple(sorted(REASONING_PARSERS))}",
                                      param="reasoning_parser")
        if not 0 < self.structured_outputs_compile_timeout < math.inf:  # nan too
            raise InvalidRequestError("structured_outputs_compile_timeout must be positive",
                                      param="structured_outputs_compile_timeout")


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's flags; see sluice.engine.lora)."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters in one batch (slots of stacked weights)
    max_lora_rank: int = 16  # largest adapter rank accepted; slots are this wide
    max_cpu_loras: int | None = None  # loaded adapters kept in host memory (None: max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise InvalidRequestError("max_loras must be at least 1", param="max_loras")
        if self.max_lora_rank < 1:
            raise InvalidRequestError("max_lora_rank must be at least 1", param="max_lora_rank")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidRequestError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
                param="max_cpu_loras")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")  # vLLM's names


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config` in vLLM's JSON shape (see sluice.engine.spec_decode).

    `adaptive` (sluice's): speculate only when the measured acceptance and step-time
    curve say the step gains tokens per second; False always drafts (tests).
    `draft_num_kv_blocks` (sluice's): blocks of the draft model's own KV pool (None: as
    many as the target's pool, which holds every running sequence's context).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 5  # ngram: longest suffix looked up
    # suffix decoding (Arctic; vLLM's field names)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None  # no speculation above this many running
    adaptive: bool = True
    model: str | None = None  # draft_model: the draft's checkpoint dir, GGUF or hub name
    draft_num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        draft = self.method == "draft_model"
        checks: list[tuple[bool, str, str]] = [
            (self.method in SPECULATIVE_METHODS, "method",
             f"must be one of {SPECULATIVE_METHODS}"),
            (not draft or bool(self.model), "model", "is required by method 'draft_model'"),
            (draft or self.model is None, "model", "is only for method 'draft_model'"),
            (self.draft_num_kv_blocks is None or self.draft_num_kv_blocks >= 1,
             "draft_num_kv_blocks", "must be at least 1"),
            (1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
             "must be in [1, 16]"),
            (self.prompt_lookup_min >= 1, "prompt_lookup_min", "must be at least 1"),
            (self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
             "must be >= prompt_lookup_min"),
            (self.suffix_decoding_max_tree_depth >= 1, "suffix_decoding_max_tree_depth",
             "must be at least 1"),
            (self.suffix_decoding_max_cached_requests >= 0,
             "suffix_decoding_max_cached_requests", "must be non-negative"),
            (self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor",
             "must be positive"),
            (0.0 <= self.suffix_decoding_min_token_prob <= 1.0,
             "suffix_decoding_min_token_prob", "must be in [0, 1]"),
            (self.disable_by_batch_size is None or self.disable_by_batch_size >= 1,
             "disable_by_batch_size", "must be at least 1"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidRequestError(
                    f"speculative_config.{name} {why}, got {getattr(self, name)!r}",
                    param=f"speculative_config.{name}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """From the flag's JSON text or a dict; unknown fields are an error naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_object(value, "speculative_config")
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be a JSON object",
                                      param="speculative_config")
        if "model" in value and "method" not in value:  # vLLM: a model alone is a draft
            value = {**value, "method": "draft_model"}
        hints = typing.get_type_hints(cls)
        for key, item in value.items():
            if key not in hints:
                raise InvalidRequestError(f"unknown speculative_config field {key!r}",
                                          param=f"speculative_config.{key}")
            if not _is_a(item, hints[key]):
                raise InvalidRequestError(
                    f"speculative_config.{key} must be {_type_name(hints[key])}, "
                    f"got {item!r}", param=f"speculative_config.{key}")
            owner = _method_of(key)
            if owner is not None and owner != value.get("method", cls.method):
                raise InvalidRequestError(
                    f"speculative_config.{key} is only for method {owner!r}",
                    param=f"speculative_config.{key}")
        try:
            return cls(**value)
        except TypeError as exc:
            raise InvalidRequestError(f"speculative_config: {exc}",
                                      param="speculative_config") from None


def _method_of(field_name: str) -> str | None:
    """The speculative method a field configures (None: every method's)."""
    if field_name.startswith("prompt_lookup_"):
        return "ngram"
    if field_name.startswith("suffix_decoding_"):
        return "suffix"
    return "draft_model" if field_name in ("model", "draft_num_kv_blocks") else None


def _is_a(value: Any, hint: Any) -> bool:
    """JSON's types, strictly: a bool is no number, a float no int (4.0 is not 4)."""
    return any(value is None if t is type(None) else
               isinstance(value, bool) == (t is bool)
               and isinstance(value, (int, float) if t is float else t)
               for t in typing.get_args(hint) or (hint,))


def _checked_option(key: str, value: Any, hint: Any) -> Any:
    """An engine option's value if it has its field's type (None: the field's own check);
    a path is taken for a string. `enable_prefix_caching="False"` would be true, and
    `max_num_seqs=2.5` a batch of 2.5, so a wrong type is an error naming the option."""
    if isinstance(value, os.PathLike) and _is_a("", hint):
        value = os.fspath(value)
    if value is None or _is_a(value, hint):
        return value
    wanted = " or ".join(n for n in _type_name(hint).split(" or ") if n != "null")
    raise InvalidRequestError(f"{key} must be {wanted}, got {value!r}", param=key)


def _type_name(hint: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
             type(None): "null"}
    return " or ".join(names[t] for t in typing.get_args(hint) or (hint,))


KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (see sluice.engine.kv_transfer): where this engine
    serves the KV of finished prefills, how long it holds it, and what a decode does when
    pulling it fails (vLLM's `kv_load_failure_policy`)."""

    kv_transfer_host: str = "127.0.0.1"  # the transfer server's address (bound, advertised)
    kv_transfer_port: int = 0  # 0: any free port
    kv_lease_timeout: float = 30.0  # seconds a prefill's blocks are held for the decode side
    kv_transfer_timeout: float = 10.0  # seconds a pull may take before it counts as failed
    kv_load_failure_policy: str = "recompute"  # recompute locally | fail the request (503)

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise InvalidRequestError(f"kv_load_failure_policy must be one of "
                                      f"{KV_LOAD_FAILURE_POLICIES}",
                                      param="kv_load_failure_policy")
        if not 0 <= self.kv_transfer_port <= 65535:
            raise InvalidRequestError("kv_transfer_port must be in [0, 65535]",
                                      param="kv_transfer_port")
        for name in ("kv_lease_timeout", "kv_transfer_timeout"):
            if not 0 < getattr(self, name) < math.inf:  # nan too
                raise InvalidRequestError(f"{name} must be positive", param=name)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    speculative: SpeculativeConfig | None = None  # --speculative-config

    @classmethod
    def from_options(cls, model: str | os.PathLike[str] | None = None,
                     **options: Any) -> EngineConfig:
        """Build from flat options; raise InvalidRequestError naming an unknown one."""
        layers: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {},
                                             "structured": {}, "lora": {}, "kv_transfer": {}}
        speculative = SpeculativeConfig.parse(options.pop("speculative_config", None))
        classes = (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                   ("structured", StructuredOutputsConfig), ("lora", LoRAConfig),
                   ("kv_transfer", KVTransferConfig))
        owners = {f.name: name for name, klass in classes for f in dataclasses.fields(klass)}
        hints = {k: v for _, klass in classes for k, v in typing.get_type_hints(klass).items()}
        layers["model"]["model"] = _checked_option("model", model, hints["model"])
        for key in ("hf_overrides", "pooler_config"):  # LLM(hf_overrides={...}), vLLM's
            if isinstance(options.get(key), dict):
                options[key] = json.dumps(options[key])
        for key, value in options.items():
            if key not in owners:
                raise InvalidRequestError(f"unknown engine option {key!r}", param=key)
            layers[owners[key]][key] = _checked_option(key, value, hints[key])
        lora = layers["lora"]
        sizes = [key for key in lora if key != "enable_lora" and lora[key] is not None]
        if sizes and not lora.get("enable_lora"):  # vLLM ignores them; here they'd do nothing
            raise InvalidRequestError(f"{sizes[0]} needs enable_lora (--enable-lora)",
                                      param=sizes[0])
        return cls(ModelConfig(**layers["model"]), CacheConfig(**layers["cache"]),
                   SchedulerConfig(**layers["scheduler"]),
                   StructuredOutputsConfig(**layers["structured"]), LoRAConfig(**layers["lora"]),
                   KVTransferConfig(**layers["kv_transfer"]), speculative)
