"""The engine core: token ids in, token ids out. Scheduler, model, sampler; no text.

    add(CoreRequest) ──► Request(n Sequences) ──► Scheduler.waiting
    step():  chunks = scheduler.schedule()          who computes which tokens
             logits = runner.execute(chunks)         K/V written, logits for chunk ends
             scheduler.update_from_output(chunks)    num_computed advanced, blocks cached
             tokens = sampler(logits, seqs)          one token per sequence at its end
             postprocess: append, stop on tokens, free finished -> SeqUpdates

Everything here works on token ids: end-of-sequence, `stop_token_ids`, `max_tokens`
and the context length end a sequence in the core. Text (detokenizing, stop strings,
output kinds) belongs to the front end's `OutputProcessor`, which tells the core to
`finish` a sequence whose text hit a stop string. That split is vLLM V1's: the core can
then run in its own process (`core_client.ProcessCore`) and ship each step's new
tokens to the HTTP front end as one small message, while detokenization runs beside
the next forward pass instead of before it.

Single-threaded and synchronous: `LLMEngine` drives it in-process, `core_client` on a
thread or in a child process.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig, SpeculativeConfig
from sluice.engine.kv_transfer import KVTransfer, KVTransferError
from sluice.engine.lora import LoRAAdapter, LoRACache
from sluice.engine.messages import CoreInfo, CoreRequest, SeqUpdate
from sluice.engine.outputs import RequestMetrics
from sluice.engine.pooling import TOKEN_LEVEL, Pooler, label_scores
from sluice.engine.sampler import Sampler, SampleResult, logprob_entry
from sluice.engine.scheduler import ScheduledChunk, Scheduler
from sluice.engine.sequence import Request, Sequence
from sluice.engine.spec_decode import (
    EXACT_TOKENS,
    PREDICTION_TOKENS,
    PROPOSERS,
    SpecDecoder,
)
from sluice.engine.stats import EngineStats, IterationTokens
from sluice.engine.step_log import StepLog
from sluice.engine.structured_output import BACKENDS, StructuredOutputManager, ThinkingMarkers
from sluice.engine.tokenizer import default_served_name
from sluice.protocol.errors import InvalidRequestError, SluiceError
from sluice.protocol.kv_events import KVEvent

if TYPE_CHECKING:
    from sluice.engine.model_runner import ModelRunner


class EngineCore:
    """One model, one KV pool, continuous batching. Not thread-safe."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        from sluice.engine.encoder_runner import build_runner
        from sluice.engine.model_runner import SeqChunk

        self.config = config
        self.runner = runner if runner is not None else build_runner(config)
        self._chunk_cls = SeqChunk
        self.tokenizer = self.runner.tokenizer
        self.pooler: Pooler = getattr(self.runner, "pooler", Pooler())  # (fakes have none)
        # an encoder's token depends on the tokens after it: whole prompts, never a cache hit
        encoder = getattr(self.runner, "encoder_only", False)
        if encoder:
            config = replace(config, scheduler=replace(config.scheduler,
                                                       enable_chunked_prefill=False))
            self.config = config
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.runner.block_size,
                                          config.cache.enable_prefix_caching and not encoder)
        self.block_manager.attach_offload(self._build_offload(config))
        self.kv_transfer = KVTransfer(config.kv_transfer, self.block_manager,
                                      self._kv_model(default_served_name(config.model.model)),
                                      self._pool)
        lc = config.lora
        self.scheduler = Scheduler(config.scheduler, self.block_manager,
                                   lc.max_loras if lc.enable_lora else 0)
        self.loras: LoRACache | None = None
        if lc.enable_lora:
            self.loras = LoRACache(lc.cpu_capacity,
                                   lambda path: self.runner.load_lora(path, lc.max_lora_rank))
        self.sampler = Sampler(self.tokenizer.eos_token_ids, config.model.seed)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids)
        model_config = getattr(self.runner, "model_config", None)  # (fakes have none)
        self.info = CoreInfo(self.runner.model_name, self.runner.max_model_len,
                             self.runner.vocab_size, self.block_manager.num_blocks,
                             self.block_manager.block_size,
                             config.structured.structured_outputs_backend,
                             lc.enable_lora, lc.max_loras if lc.enable_lora else 0,
                             lc.max_lora_rank if lc.enable_lora else 0,
                             getattr(model_config, "num_layers", 0),
                             {k: list(v) for k, v in
                              getattr(self.runner, "lora_shapes", {}).items()},
                             config.scheduler.scheduling_policy,
                             config.structured.reasoning_parser,
                             self.pooler.width(getattr(model_config, "hidden_size", 0)),
                             getattr(model_config, "matryoshka_dimensions", None),
                             encoder or bool(getattr(self.runner, "labels", ())),
                             tuple(getattr(self.runner, "labels", ())))
        self.structured = StructuredOutputManager(
            config.structured, self._grammar_backend,
            ThinkingMarkers.of(self.tokenizer, config.structured.reasoning_parser))
        self.requests: dict[str, Request] = {}
        self.failed: list[tuple[str, SluiceError]] = []  # requests the core refused after add
        self._next_seq_id = 0
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_steps": 0}
        self.iteration_tokens = IterationTokens()  # tokens per step with output
        self._batches_seen = 0  # the offload writer's, when `tick` last looked
        self.spec = self._build_spec(config)
        self.last_chunks: list[ScheduledChunk] = []  # what the last step() ran
        self.step_log = self._open_step_log(config)  # the loop records into it

    # -- admission ----------------------------------------------------------------
    def add(self, req: CoreRequest) -> None:
        """Queue a request; raises InvalidRequestError on a duplicate id."""
        if req.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}",
                                      param="request_id")
        adapter = self._adapter(req)
        seqs = [self._new_seq(req, i) for i in range(req.params.n)]
        if adapter is not None:
            for seq in seqs:
                seq.lora, seq.adapter = req.lora, adapter
                seq.cache_salt = bytes.fromhex(adapter.key)
                seq.lora_id = int(adapter.key[:15], 16)
        request = Request(req.request_id, None, req.prompt_token_ids, req.params, seqs,
                          RequestMetrics(arrival_time=req.arrival_time),
                          siblings_pending=req.params.n > 1)
        self.requests[req.request_id] = request
        if KVTransfer.wants_pull(req.params.kv_transfer_params) and self._pull(request):
            return  # queued once its KV arrived (`_admit_pulled`)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        if request.params.structured_outputs is not None:  # scheduled once compiled
            self.structured.submit(request, time.monotonic())
        else:
            self.scheduler.add(request.seqs[0])

    def _pull(self, request: Request) -> bool:
        """P/D decode side: start pulling the prompt's KV; True while the request waits
        for it. A failure to start fails the request (policy fail) or recomputes."""
        try:
            return self.kv_transfer.start(request.seqs[0])
        except KVTransferError as exc:
            if self.kv_transfer.failed(request.request_id, exc) is not None:
                del self.requests[request.request_id]
                self.failed.append((request.request_id, exc))
                return True
            return False

    def _admit_pulled(self) -> None:
        """Queue requests whose KV pull finished (hits on what arrived, or recompute);
        fail those whose pull failed under kv_load_failure_policy=fail."""
        for request_id, error in self.kv_transfer.poll():
            request = self.requests.get(request_id)
            if request is None:  # aborted while pulling
                continue
            if error is not None:
                del self.requests[request_id]
                self.failed.append((request_id, error))
            else:
                self._enqueue(request)

    def _pool(self) -> Any:
        from sluice.engine.kv_offload import PoolAccess

        layers: Any = self.runner.model.layers
        return PoolAccess([(layer.attention.kv_cache.k, layer.attention.kv_cache.v)
                           for layer in layers])

    def _build_spec(self, config: EngineConfig) -> SpecDecoder | None:
        """Speculative decoding: --speculative-config's, whose step-time curve is
        measured now on a real model runner (fakes in tests have no cost to measure);
        without one, for requests with a predicted output only (OpenAI's `prediction`),
        measured when the first comes, on a free block (`lazy_calibration`). (Tests set
        `spec` to None for plain decoding.)"""
        sc, sp = config.scheduler, config.speculative
        if sp is None:
            sp = SpeculativeConfig(num_speculative_tokens=PREDICTION_TOKENS)
            spec = SpecDecoder(sp, self.sampler, self.block_manager, self.info.max_model_len,
                               predictions_only=True)
        else:
            proposer = PROPOSERS[sp.method]().from_engine(sp, config, self.runner)
            spec = SpecDecoder(sp, self.sampler, self.block_manager, self.info.max_model_len,
                               proposer)
        graph = getattr(self.runner, "decode_graph", None)
        spec.graph_rows = graph.max_rows if graph is not None else None
        if not sp.adaptive or not hasattr(self.runner, "model"):
            return spec
        if not spec.predictions_only:
            spec.calibrate(self.runner, self._chunk_cls,
                           min(sc.max_num_batched_tokens,
                               sc.max_num_seqs * (sp.num_speculative_tokens + 1),
                               self.info.max_model_len), sc.max_num_seqs)
            return spec

        def calibrate() -> None:
            block = self.block_manager.scratch_block()
            if block is None:  # the pool is full: real steps fill the curve
                return
            try:
                spec.calibrate(self.runner, self._chunk_cls,
                               min(sc.max_num_batched_tokens, EXACT_TOKENS + 1,
                                   self.info.max_model_len), sc.max_num_seqs, block)
            finally:
                self.block_manager.release([block])

        spec.lazy_calibration = calibrate
        return spec

    def _build_offload(self, config: EngineConfig) -> Any:
        cache = config.cache
        if cache.kv_offload is None and cache.kv_store is None:
            return None
        from sluice.engine.kv_offload import build_offload

        return build_offload(cache.kv_offload, cache.kv_store,
                             self._kv_model(config.model.model or self.runner.model_name),
                             self.runner.block_size, self.runner.model.layers)

    def _kv_model(self, name: str) -> str:
        """The model's name as its KV blocks' identity (offload namespaces, P/D hand-offs),
        with the runner's RoPE variant where blocks of one model differ by it."""
        variant = self.runner.rope_variant
        return f"{name} ({variant})" if variant else name

    def _adapter(self, req: CoreRequest) -> LoRAAdapter | None:
        """The request's LoRA adapter, loaded (or from the host cache); raises
        InvalidRequestError for a broken adapter or when LoRA is off."""
        if req.lora is None:
            return None
        if self.loras is None:
            raise InvalidRequestError(f"the model {req.lora.lora_name!r} is a LoRA adapter, "
                                      "but LoRA is not enabled (--enable-lora)", param="model")
        return self.loras.get(req.lora)

    def _grammar_backend(self, name: str) -> Any:
        native = getattr(self.runner, "native", None)
        return BACKENDS[name](self.tokenizer, self.runner.vocab_size,
                              native.apply_token_bitmask if native is not None else None)

    def _new_seq(self, req: CoreRequest, index: int) -> Sequence:
        self._next_seq_id += 1
        params = req.params
        gen = None
        if params.seed is not None:
            gen = torch.Generator()
        num_prompt = len(req.prompt_token_ids) - req.num_output_tokens  # resumed: output
        seq = Sequence(self._next_seq_id, req.request_id, index, list(req.prompt_token_ids),
                       num_prompt, params, req.max_tokens, req.priority, req.arrival_time,
                       generator=gen, seed=None if params.seed is None else params.seed + index,
                       pooling=(req.pooling_type or self.pooler.pooling_type)
                       if req.pooling else "",
                       use_activation=req.use_activation)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        if params.prompt_logprobs is not None and index == 0 and not req.num_output_tokens:
            seq.prompt_logprobs = [None]  # the first token: nothing before it predicts it
        if params.thinking_token_budget is not None and params.structured_outputs is None:
            self.structured.replay(seq)  # (a grammar's sequences: once compiled)
        return seq

    def abort(self, request_id: str) -> None:
        """Finish every sequence of the request and free its blocks now (unknown: no-op)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if self.structured.is_pending(request_id):
            self.structured.cancel(request_id)
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"

    def finish(self, request_id: str, index: int) -> None:
        """End one sequence that the front end stopped (a stop string in its text)."""
        request = self.requests.get(request_id)
        if request is None:
            return
        seq = request.seqs[index]
        if not seq.is_finished:  # a stop string needs text: siblings are scheduled by now
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)
        if request.finished:
            del self.requests[request_id]

    # -- the loop -----------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        """Schedule, run, sample; one update per sequence that got a token."""
        self._admit_compiled()
        self._admit_pulled()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, self.config.scheduler.max_num_batched_tokens)
        chunks = self.scheduler.schedule()
        self.last_chunks = chunks
        drafts = self.spec.fit(chunks) if self.spec is not None else {}
        if not chunks:
            self.structured.wait(0.01)  # only grammars, KV pulls or fetches from an
            self.kv_transfer.wait(0.01)  # offload tier pending: do not spin
            if self.block_manager.offload is not None:
                self.block_manager.offload.wait(0.01)
            return []
        self._mark_scheduled(chunks)
        self.block_manager.flush_evicted()  # evicted blocks go down a tier before overwrites
        start = time.perf_counter()
        seq_chunks = [self._seq_chunk(c, drafts) for c in chunks]
        logits = self.runner.execute(seq_chunks)
        pooled = [c for c in chunks if c.seq.pooling]
        if any(c.prompt_logits for c in seq_chunks):
            logits = self._take_prompt_logprobs(chunks, seq_chunks, logits)
        self.scheduler.update_from_output(  # drafted chunks: after verification (commit)
            [c for c in chunks if c.seq not in drafts] if drafts else chunks)
        self._after_forward(chunks, time.perf_counter() - start)
        sampled = [c.seq for c in chunks if c.need_logits and not c.seq.pooling]
        results = self._sample(logits, sampled, drafts)
        self._counters["num_steps"] += 1
        counted = self._tokens_counted()
        updates = [self._postprocess(seq, result, seq in drafts)
                   for seq, result in zip(sampled, results, strict=True)]
        if pooled:
            assert self.runner.pooled is not None
            updates += self._embed(self._keep_pooled(pooled, self.runner.pooled))
        self.iteration_tokens.observe(self._tokens_counted() - counted)
        return [u for u in updates if u is not None]

    @staticmethod
    def _keep_pooled(chunks: list[ScheduledChunk], rows: list[torch.Tensor]) -> list[Sequence]:
        """Keep each pooling chunk's entry (the runner's: LAST a chunk's last token's final
        hidden state, CLS its first's, MEAN their sum, ALL every one); the sequences whose
        prompt this step completed. A chunk at position 0 starts over (a preempted prompt
        computes again from there: its cached blocks are never hit,
        `computes_whole_prompt`)."""
        done = []
        for chunk, row in zip(chunks, rows, strict=True):
            seq = chunk.seq
            if seq.pooling == "MEAN" and chunk.start_pos:
                seq.pooled = seq.pooled + row
            elif seq.pooling == TOKEN_LEVEL and chunk.start_pos:
                seq.pooled = torch.cat([seq.pooled, row])
            elif seq.pooling != "CLS" or chunk.start_pos == 0:
                seq.pooled = row
            if chunk.need_logits:
                done.append(seq)
        return done

    def _embed(self, seqs: list[Sequence]) -> list[SeqUpdate]:
        """Finish each embedding whose prompt this step completed: its pooled row (MEAN's
        sum over the prompt's length; a token task's rows, one a prompt token) through the
        activation (`_activate`), as float32 bytes; nothing is sampled and its blocks go
        back (full ones stay cached)."""
        if not seqs:
            return []
        updates = []
        for seq, vector in zip(seqs, self._pooled_vectors(seqs), strict=True):
            seq.pooled = None
            request = self.requests.pop(seq.request_id)
            seq.finish_reason = "stop"
            self.scheduler.finish(seq)
            self._counters["prompt_tokens"] += seq.num_prompt_tokens
            updates.append(SeqUpdate(seq.request_id, 0, [], finish_reason="stop",
                                     num_cached_tokens=max(seq.num_cached_tokens, 0),
                                     scheduled_time=request.metrics.first_scheduled_time,
                                     num_preemptions=seq.num_preemptions,
                                     num_prefill_chunks=seq.num_prefill_chunks,
                                     embedding=vector.astype("<f4").tobytes()))
        return updates

    def _pooled_vectors(self, seqs: list[Sequence]) -> list[np.ndarray]:
        """Each sequence's answer: one vector (MEAN divided by the prompt's length, then
        the checkpoint's Dense modules, if any) or, for a token task, one row a token;
        activated as each asks."""
        whole = [s for s in seqs if s.pooling != TOKEN_LEVEL]
        out: dict[int, np.ndarray] = {}
        if whole:
            hidden = torch.stack([s.pooled for s in whole])
            lengths = [s.num_prompt_tokens if s.pooling == "MEAN" else 1 for s in whole]
            if max(lengths) > 1:
                hidden /= torch.tensor(lengths, dtype=hidden.dtype).unsqueeze(1)
            hidden = self._activate(self.pooler.project(hidden), whole)
            out.update(zip(map(id, whole), hidden.cpu().numpy(), strict=True))
        for seq in seqs:
            if seq.pooling == TOKEN_LEVEL:
                rows = seq.pooled
                out[id(seq)] = self._activate(rows, [seq] * rows.shape[0]).cpu().numpy()
        return [out[id(s)] for s in seqs]

    def _activate(self, rows: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Each row through the pooler's activation where its request wants it
        (`PoolingParams.use_activation`; None: the model's default): a classifier's logits
        to label scores (on by default), an embedding L2-normalized (the pooler's)."""
        labels = bool(self.info.labels)
        default = True if labels else self.pooler.normalize
        wanted = [default if s.use_activation is None else s.use_activation for s in seqs]
        if not any(wanted):
            return rows
        multi = getattr(getattr(self.runner, "model_config", None), "multi_label", False)
        done = label_scores(rows, multi) if labels else \
            torch.nn.functional.normalize(rows, dim=-1)
        if all(wanted):
            return done
        return torch.where(torch.tensor(wanted).unsqueeze(1), done, rows)

    def _tokens_counted(self) -> int:
        """Prompt plus generated tokens counted so far (vllm:prompt_tokens' and
        vllm:generation_tokens' way: a prompt once, at its request's first token)."""
        return self._counters["prompt_tokens"] + self._counters["generation_tokens"]

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence],
                drafts: dict[Sequence, list[int]]) -> list[list[SampleResult]]:
        """Each sampled sequence's new tokens: one, or a verified draft's 1..k+1. Grammar
        masks first, on every row (a drafted sequence's verify rows follow its draft)."""
        self.structured.mask(logits, sampled, drafts)
        self.structured.force(logits, sampled, drafts)
        if self.spec is not None:
            return self.spec.sample(logits, sampled, drafts, self._sample_plain)
        return [[r] for r in self._sample_plain(logits, sampled)]

    def _sample_plain(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampleResult]:
        return self.sampler(logits, seqs) if seqs else []

    def _after_forward(self, chunks: list[ScheduledChunk], seconds: float) -> None:
        """Offload tiers: write newly cached blocks through; learn the prefill cost per
        token from steps that are mostly prefill (what a load from a tier must beat)."""
        if self.spec is not None:
            self.spec.observe_step(sum(c.num_tokens for c in chunks), seconds)
        offload = self.block_manager.offload
        if offload is None:
            return
        offload.write_through(self.block_manager.drain_newly_cached())
        prefill = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        if prefill >= 64 and prefill >= 8 * sum(1 for c in chunks if c.num_tokens == 1):
            offload.cost.observe_prefill(seconds, sum(c.num_tokens for c in chunks))

    def _admit_compiled(self) -> None:
        """Schedule requests whose grammar compiled; fail those whose compile failed."""
        if not self.structured.has_pending:
            return
        ready, failed = self.structured.poll(time.monotonic())
        for request in ready:
            self.scheduler.add(request.seqs[0])
        for request_id, error in failed:
            del self.requests[request_id]
            self.failed.append((request_id, error))

    def drain_failed(self) -> list[tuple[str, SluiceError]]:
        """Requests refused since the last call (a constraint that did not compile, or
        whose grammar refused a token the mask allowed)."""
        failed, self.failed = self.failed, []
        return failed

    def _seq_chunk(self, chunk: ScheduledChunk, drafts: dict[Sequence, list[int]]) -> Any:
        seq, start = chunk.seq, chunk.start_pos
        out = self._chunk_cls(seq.token_ids[start:start + chunk.num_tokens], start,
                              seq.block_table, chunk.need_logits, seq.adapter)
        if seq.pooling:
            out.pool = seq.pooling
        elif drafts and seq in drafts:
            out.num_logits = len(drafts[seq]) + 1  # the last token's row and each draft's
        elif seq.wants_prompt_logits:
            out.need_logits, out.prompt_logits, out.num_logits = True, True, chunk.num_tokens
        return out

    def _take_prompt_logprobs(self, chunks: list[ScheduledChunk], seq_chunks: list[Any],
                              logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs that this step's prompt-logits rows give (row j of a
        chunk at `start` predicts the token at start + j + 1); the logits of the rows to
        sample from, in chunk order, as a plain step returns them."""
        keep: list[int] = []
        row = 0
        for chunk, sc in zip(chunks, seq_chunks, strict=True):
            rows = sc.num_logits if sc.need_logits and not sc.pool else 0
            if sc.prompt_logits:
                self._prompt_logprobs(chunk.seq, chunk.start_pos, logits[row:row + rows])
                if chunk.need_logits:  # the prompt's last token: sampled from as usual
                    keep.append(row + rows - 1)
            else:
                keep.extend(range(row, row + rows))
            row += rows
        return logits[keep]

    @staticmethod
    def _prompt_logprobs(seq: Sequence, start: int, rows: torch.Tensor) -> None:
        """Append the prompt positions these rows predict and `seq` has not recorded (a
        recompute after preemption predicts them again): {prompt token: logprob} and the
        `prompt_logprobs` likeliest, as a sampled token's entry. In slices, so a long
        chunk's log-softmax does not double its logits' memory at once."""
        assert seq.prompt_logprobs is not None
        top = seq.params.prompt_logprobs or 0
        # the row predicting the next position to record; never negative: such a sequence
        # takes no prefix-cache hits, so its chunks start at 0 or where the last one ended
        first = len(seq.prompt_logprobs) - 1 - start
        assert first >= 0, f"prompt positions {len(seq.prompt_logprobs)}..{start} never computed"
        end = min(rows.shape[0], seq.num_prompt_tokens - 1 - start)
        for lo in range(first, end, 256):
            hi = min(lo + 256, end)
            lp = rows[lo:hi].log_softmax(dim=-1)
            actual = seq.token_ids[start + lo + 1:start + hi + 1]
            own = lp.gather(1, torch.tensor(actual).unsqueeze(1)).squeeze(1).tolist()
            best = lp.topk(top, dim=-1) if top else None
            ids = best.indices.tolist() if best is not None else [[]] * len(actual)
            values = best.values.tolist() if best is not None else [[]] * len(actual)
            seq.prompt_logprobs += [logprob_entry(*entry) for entry in
                                    zip(actual, own, ids, values, strict=True)]

    def _mark_scheduled(self, chunks: list[ScheduledChunk]) -> None:
        now = time.time()
        for chunk in chunks:
            metrics = self.requests[chunk.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            if chunk.seq.num_output_tokens == 0:
                chunk.seq.num_prefill_chunks += 1

    def _postprocess(self, seq: Sequence, results: list[SampleResult],
                     drafted: bool = False) -> SeqUpdate | None:
        """Append the tokens one by one, each through the stop checks (a verified draft
        stops where plain decoding would, the rest dropped). None: the request failed
        (its grammar refused a token), in this sequence or a sibling before it."""
        request = self.requests.get(seq.request_id)
        if request is None:
            return None
        tokens: list[int] = []
        new_logprobs: list[Any] | None = None
        for result in results:
            tokens.append(self._append(request, seq, result))
            if seq.logprobs is not None and result.top_logprobs is not None:
                new_logprobs = (new_logprobs or []) + [result.top_logprobs]
            if seq.finish_reason is not None:
                break
        if seq.request_id not in self.requests:
            return None
        kv_params = None
        if seq.finish_reason is not None:
            kv_params = self.kv_transfer.on_finished(seq)  # P/D prefill side: hold its KV
            self.scheduler.finish(seq)
            if request.finished:
                del self.requests[seq.request_id]
        elif drafted:
            assert self.spec is not None
            self.spec.commit(seq)
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and seq.num_output_tokens == len(tokens):
            prompt_logprobs = seq.prompt_logprobs  # with the first token, once
        return SeqUpdate(seq.request_id, seq.index, tokens, new_logprobs,
                         seq.cumulative_logprob, seq.finish_reason,
                         seq.stop_reason,
                         max(request.seqs[0].num_cached_tokens, 0),
                         request.metrics.first_scheduled_time, seq.num_preemptions,
                         request.seqs[0].num_prefill_chunks, kv_params, prompt_logprobs,
                         accepted_prediction_tokens=seq.num_accepted_prediction_tokens,
                         rejected_prediction_tokens=seq.num_rejected_prediction_tokens)

    def _append(self, request: Request, seq: Sequence, result: SampleResult) -> int:
        token = result.token_id
        seq.token_ids.append(token)
        if seq.grammar is not None or seq.thinking is not None:
            error = self.structured.accept(seq, token)
            if error is not None:  # fail the request: every sequence ends, blocks freed
                self.abort(request.request_id)
                self.failed.append((request.request_id, error))
                return token
        self._counters["generation_tokens"] += 1
        if seq.logprobs is not None and result.top_logprobs is not None:
            seq.logprobs.append(result.top_logprobs)
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + (result.logprob or 0.0)
        if seq.num_output_tokens == 1:
            self._on_first_token(request, seq)
        self._check_stop(seq, token)
        return token

    def _on_first_token(self, request: Request, seq: Sequence) -> None:
        if seq.index == 0:
            self._counters["prompt_tokens"] += seq.num_prompt_tokens
        if request.siblings_pending:  # the prompt's full blocks are cached now
            request.siblings_pending = False
            for sibling in request.seqs[1:]:
                self.scheduler.add(sibling)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if seq.finish_reason is not None or (seq.grammar is not None
                                              and seq.grammar.is_terminated()):
            seq.finish_reason = "stop"  # the grammar is complete (or refused the token)
            return
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.info.max_model_len:
            seq.finish_reason = "length"

    # -- introspection --------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.requests or self.failed)

    def tick(self) -> bool:
        """Housekeeping the loop runs even when idle (P/D leases past their TTL release
        their blocks); whether anything changed that the stats show (that too, or the
        offload writer stored blocks after the last step: the stored bytes changed)."""
        changed = self.kv_transfer.tick()
        offload = self.block_manager.offload
        if offload is not None and offload.batches_written != self._batches_seen:
            self._batches_seen = offload.batches_written
            changed = True
        return changed

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=bm.usage, num_kv_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_preemptions=sched.num_preemptions, **self._counters,
            kv_offload=bm.offload.stats() if bm.offload is not None else {},
            running_lora_adapters=_adapter_names(sched.running),
            waiting_lora_adapters=_adapter_names(sched.waiting),
            max_lora=sched.max_loras, kv_transfer=self.kv_transfer.stats_dict(),
            # (without --speculative-config, once a prediction has drafted)
            spec_decode=self.spec.stats() if self.spec is not None and (
                not self.spec.predictions_only or self.spec.num_drafts) else {},
            iteration_tokens=list(self.iteration_tokens.counts),
            iteration_tokens_sum=self.iteration_tokens.total)

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last call."""
        return self.block_manager.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Stop the compile thread's queue (a compile already running ends by itself) and
        the offload writer (after the writes it has queued); close the step log."""
        self.structured.close()
        self.kv_transfer.close()
        if self.block_manager.offload is not None:
            self.block_manager.offload.close()
        if self.step_log is not None:
            self.step_log.close()

    def _open_step_log(self, config: EngineConfig) -> StepLog | None:
        """`--step-log DIR`: this core's file, the engine's shape as its first line."""
        if config.scheduler.step_log is None:
            return None
        sched = config.scheduler
        return StepLog(config.scheduler.step_log, {
            "model": self.info.model_name, "block_size": self.block_manager.block_size,
            "num_kv_blocks": self.block_manager.num_blocks, "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens})


def _adapter_names(seqs: list[Sequence]) -> str:
    """Comma-separated names of the adapters `seqs` use (vllm:lora_requests_info)."""
    return ",".join(sorted({s.lora.lora_name for s in seqs if s.lora is not None}))
