"""Everything one worker app owns, created by `build_app` and passed to every handler.

The engine may arrive after the app starts serving (`sluice worker` listens while the
model loads, so `/health` can say 503 until it is ready): `attach(engine)` sets it;
until then generation endpoints answer 503 with Retry-After.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sluice.engine.generation_config import overridden_warning
from sluice.engine.stats import EngineStats
from sluice.observe.tracing import start_tracing
from sluice.protocol.errors import NotFoundError, ServiceUnavailableError
from sluice.worker.config import WorkerConfig
from sluice.worker.generation import Admission
from sluice.worker.lora import LoRARegistry
from sluice.worker.metrics import WorkerMetrics
from sluice.worker.pd import PDCollector, PDRole
from sluice.worker.reasoning import REASONING_PARSERS, ReasoningParser
from sluice.worker.tool_parsers import get_tool_parser

if TYPE_CHECKING:
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.lora import LoRARequest
    from sluice.engine.sampling_params import SamplingParams

log = logging.getLogger("sluice.worker")


class WorkerState:
    """The worker's engine slot, admission counter, metrics and tracer (event-loop thread
    only)."""

    def __init__(self, engine: AsyncEngine | None, config: WorkerConfig) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.admission = Admission(config.max_pending_requests, config.retry_after_seconds)
        self.metrics = WorkerMetrics(self.stats, lambda: self.model_name,
                                     config.metrics_buckets)
        self.tracing = start_tracing(config.tracing)  # None: tracing off
        self.tool_parser = get_tool_parser(config.tool_call_parser)
        self.reasoning_parser = REASONING_PARSERS.get(config.reasoning_parser or "")
        self.loras = LoRARegistry(self)
        self.pd = PDRole(config.role)  # P/D role and epoch (sluice.worker.pd)
        self.metrics.registry.register(PDCollector(self.pd, lambda: self.model_name))
        if engine is not None:
            self.attach(engine)

    def attach(self, engine: AsyncEngine) -> None:
        if self.config.chat_template is not None:  # --chat-template replaces the model's
            engine.tokenizer.chat_template = self.config.chat_template
        self.engine = engine
        if self.config.generation_defaults:  # once: the engine is attached once
            log.warning(overridden_warning(self.config.generation_defaults,
                                           "--generation-config vllm"))
        for name, path in self.config.lora_modules:  # --lora-modules: a bad one stops start-up
            self.loras.add(name, path)

    @property
    def engine_thinks(self) -> bool:
        """Whether the engine knows this worker's reasoning parser (`sluice worker
        --reasoning-parser` gives it both): its grammars wait for the thinking, and a
        `thinking_token_budget` is kept."""
        info = self.require_engine().inputs.info
        return self.reasoning_parser is not None and \
            info.reasoning_parser == self.reasoning_parser.name

    def reasoning_for(self, params: SamplingParams) -> ReasoningParser | None:
        """The parser that splits a request's output into thinking and answer: the
        worker's, unless the output is constrained and its engine holds the grammar from
        the first token (an engine without the same `reasoning_parser`): all answer then."""
        if params.structured_outputs is None or self.engine_thinks:
            return self.reasoning_parser
        return None

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None

    @property
    def model_name(self) -> str:
        if self.config.served_model_names:
            return self.config.served_model_names[0]
        return self.engine.model_name if self.engine is not None else "loading"

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.config.served_model_names or (self.model_name,)

    def stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    def require_engine(self) -> AsyncEngine:
        if self.engine is not None and self.engine.dead is not None:
            raise self.engine.dead
        if self.engine is None:
            raise ServiceUnavailableError("the model is still loading; retry shortly",
                                          retry_after=self.config.retry_after_seconds)
        return self.engine

    def check_model(self, model: str | None) -> str:
        """The served name for `model` (None: the default); 404 for any other name."""
        self.require_engine()
        if model is None or model in self.served_names or model in self.loras.adapters:
            return model or self.model_name
        raise NotFoundError(f"The model `{model}` does not exist.", param="model")

    def check_generates(self, model: str | None) -> str:
        """`check_model`, and the input processor's 400 for a pooling model, before any
        templating (a BERT checkpoint has no chat template to complain about)."""
        name = self.check_model(model)
        self.require_engine().inputs.check_generates()
        return name

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.adapters.get(model) if model is not None else None
