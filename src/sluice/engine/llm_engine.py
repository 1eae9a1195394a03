"""The engine in one thread: the core (tokens) plus the front end's text layer.

    add_request ──► InputProcessor.prepare ──► CoreRequest ──► EngineCore.add
    step():  updates = core.step()                       schedule, run, sample
             outputs, stops = output_processor.process   detokenize, stop strings
             core.finish(each stopped sequence)          before the next step

`LLM` drives it to completion for offline use; servers run the same two halves split
across processes (`AsyncEngine`). Single-threaded and synchronous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig
from sluice.engine.core import EngineCore
from sluice.engine.input_processor import InputProcessor
from sluice.engine.lora import LoRARequest
from sluice.engine.messages import CoreRequest, SeqUpdate
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.outputs import EmbeddingRequestOutput, RequestOutput
from sluice.engine.pooling_params import PoolingParams
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler
from sluice.engine.stats import EngineStats
from sluice.protocol.kv_events import KVEvent

if TYPE_CHECKING:
    from sluice.engine.model_runner import ModelRunner


class LLMEngine:
    """One model, one KV pool, continuous batching, text out. Not thread-safe."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.core = EngineCore(config, runner)
        self.runner = self.core.runner
        self.tokenizer = self.core.tokenizer
        self.model_name = self.core.info.model_name
        self.max_model_len = self.core.info.max_model_len
        self.inputs = InputProcessor(self.core.info, self.tokenizer)
        self.outputs = OutputProcessor(self.tokenizer)
        self._embedding: dict[str, list[int]] = {}  # the embeddings asked: their prompts
        self.embeddings: dict[str, EmbeddingRequestOutput] = {}  # those done, until taken

    @property
    def block_manager(self) -> BlockManager:
        return self.core.block_manager

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self.core.scheduler = scheduler

    # -- admission ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate, tokenize and queue a request; raises InvalidRequestError /
        ContextLengthError naming the parameter. `lora_request`: run it with that adapter."""
        request = self.inputs.prepare(request_id, prompt, params, priority, arrival_time,
                                      lora=lora_request)
        self.submit(request, prompt if isinstance(prompt, str) else None)

    def submit(self, request: CoreRequest, prompt: str | None = None) -> None:
        self.core.add(request)  # raises on a duplicate id, before the text side is touched
        self.outputs.add(request.request_id, prompt, request.prompt_token_ids, request.params,
                         request.arrival_time)

    def add_embedding_request(self, request_id: str, prompt: str | list[int],
                              priority: int = 0, pooling: PoolingParams | None = None) -> None:
        """Queue an embedding (`EngineCore._embed`), as `pooling` asks; once a step has
        computed it, its `EmbeddingRequestOutput` is in `embeddings` (errors name
        `prompt`)."""
        request = self.inputs.prepare_pooling(request_id, prompt, priority, param="prompt",
                                              pooling=pooling)
        self.core.add(request)
        self._embedding[request_id] = request.prompt_token_ids

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request as "abort" and free its blocks now."""
        self._embedding.pop(request_id, None)
        self.abort_with_output(request_id)

    def abort_with_output(self, request_id: str) -> RequestOutput | None:
        """`abort_request`, returning the request's final output (None if unknown)."""
        self.core.abort(request_id)
        return self.outputs.abort(request_id)

    # -- the loop -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess; returns outputs of requests that progressed."""
        # A constraint that did not compile (in time) in the last step is raised before
        # this step runs, so that no other request's outputs are dropped with the error.
        failed = self.core.drain_failed()
        for request_id, _ in failed:
            self.outputs.abort(request_id)
        if failed:
            raise failed[0][1]
        self.core.tick()  # P/D leases that ended release their blocks
        updates = self.core.step()
        if self._embedding:
            updates = self._take_embeddings(updates)
        outputs, stops = self.outputs.process(updates)
        for request_id, index in stops:
            self.core.finish(request_id, index)
        return outputs

    def _take_embeddings(self, updates: list[SeqUpdate]) -> list[SeqUpdate]:
        """Keep each asked embedding's output (in `embeddings`); the other updates."""
        rest = []
        for update in updates:
            ids = self._embedding.pop(update.request_id, None)
            if ids is None or update.embedding is None:
                rest.append(update)
            else:
                self.embeddings[update.request_id] = EmbeddingRequestOutput(
                    update.request_id, ids, update.embedding, update.num_cached_tokens)
        return rest

    # -- introspection --------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.core.has_work() or self.outputs.has_unfinished()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last call."""
        return self.core.drain_kv_events()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()
