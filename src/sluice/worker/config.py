"""Worker configuration: the HTTP side of one worker (the engine has its own EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.observe.buckets import LatencyBuckets
from sluice.observe.tracing import TracingConfig
from sluice.protocol.edge import DEFAULT_MAX_BODY_BYTES
from sluice.protocol.errors import InvalidRequestError


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Names the model answers to in `model`; empty: the engine's own model_name.
    served_model_names: tuple[str, ...] = ()
    # Admission cap: HTTP requests in flight beyond this get 503 + Retry-After.
    max_pending_requests: int = 1024
    # On SIGTERM: stop accepting, let in-flight streams finish for up to this long.
    shutdown_timeout: float = 30.0
    # Publish the engine's KV events (vLLM format, ZMQ PUB) here, every interval.
    kv_events_endpoint: str | None = None
    kv_events_interval: float = 0.02
    retry_after_seconds: float = 1.0
    # Request bodies over this many bytes are refused with 413 as they arrive.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"
    # How tool calls are read from (and forced into) the model's text: worker/tool_parsers.py
    tool_call_parser: str = "hermes"
    # How a reasoning model's thinking is told from its answer (worker/reasoning.py); None:
    # all of the output is the answer
    reasoning_parser: str | None = None
    # A chat template (the text of --chat-template FILE) replacing the model's own.
    chat_template: str | None = None
    # The model's sampling defaults (its generation_config.json under --generation-config
    # auto; sluice.engine.generation_config), read at start: SamplingParams field -> value
    # for requests that leave the field out (max_tokens: still capped by the context).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    # OpenTelemetry export (off unless an endpoint is set) and histogram buckets.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    metrics_buckets: LatencyBuckets = field(default_factory=LatencyBuckets)
    # --lora-modules name=path: LoRA adapters registered at start (needs --enable-lora)
    lora_modules: tuple[tuple[str, str], ...] = ()
    # P/D disaggregation: where a router sends this worker's requests (it serves any)
    role: str = "both"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError("port must be in [0, 65535]", param="port")
        if self.max_pending_requests < 1:
            raise InvalidRequestError("max_pending_requests must be at least 1",
                                      param="max_pending_requests")
        if self.shutdown_timeout < 0:
            raise InvalidRequestError("shutdown_timeout must be non-negative",
                                      param="shutdown_timeout")
        from sluice.worker.tool_parsers import TOOL_PARSERS

        if self.tool_call_parser not in TOOL_PARSERS:
            raise InvalidRequestError(f"unknown tool_call_parser {self.tool_call_parser!r} "
                                      f"(known: {', '.join(sorted(TOOL_PARSERS))})",
                                      param="tool_call_parser")
        from sluice.worker.reasoning import REASONING_PARSERS

        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise InvalidRequestError(f"unknown reasoning_parser {self.reasoning_parser!r} "
                                      f"(known: {', '.join(sorted(REASONING_PARSERS))})",
                                      param="reasoning_parser")
        if self.role not in ("prefill", "decode", "both"):
            raise InvalidRequestError("role must be prefill, decode or both", param="role")
        if self.kv_events_interval <= 0:
            raise InvalidRequestError("kv_events_interval must be positive",
                                      param="kv_events_interval")
