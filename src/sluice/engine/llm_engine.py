"""The engine loop: `step()` = schedule, run the model, postprocess.

    add_request ──► Request(n Sequences) ──► Scheduler.waiting
    step():  chunks = scheduler.schedule()          who computes which tokens
             logits = runner.execute(chunks)         K/V written, logits for chunk ends
             scheduler.update_from_output(chunks)    num_computed advanced, blocks cached
             tokens = sampler(logits, seqs)          one token per sequence at its end
             postprocess: append, detokenize, stop checks, free finished, outputs

Single-threaded and synchronous; `AsyncEngine` runs it on its own thread for servers,
`LLM` drives it to completion for offline use.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from sluice.engine.block_manager import BlockManager, blocks_needed
from sluice.engine.config import EngineConfig
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from sluice.engine.sampler import Sampler, SampleResult
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams
from sluice.engine.scheduler import ScheduledChunk, Scheduler
from sluice.engine.sequence import Request, Sequence
from sluice.engine.stats import EngineStats
from sluice.protocol.errors import ContextLengthError, InvalidRequestError
from sluice.protocol.kv_events import KVEvent

if TYPE_CHECKING:
    from sluice.engine.model_runner import ModelRunner


class LLMEngine:
    """One model, one KV pool, continuous batching. Not thread-safe."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        from sluice.engine.model_runner import ModelRunner, SeqChunk

        self.config = config
        self.runner = runner if runner is not None else ModelRunner(config)
        self._chunk_cls = SeqChunk
        self.tokenizer = self.runner.tokenizer
        self.model_name = self.runner.model_name
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.runner.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.sampler = Sampler(self.tokenizer.eos_token_ids, config.model.seed)
        self.requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self._counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_steps": 0}

    # -- admission ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate, tokenize and queue a request; raises InvalidRequestError /
        ContextLengthError naming the parameter."""
        self.submit(self.prepare_request(request_id, prompt, params, priority, arrival_time))

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                        priority: int = 0, arrival_time: float | None = None) -> Request:
        """Everything `add_request` checks, without touching engine state (thread-safe)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", param="request_id")
        ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(len(ids), params)
        arrival = time.time() if arrival_time is None else arrival_time
        seqs = [self._new_seq(request_id, i, ids, params, max_tokens, priority, arrival)
                for i in range(params.n)]
        return Request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                       seqs, RequestMetrics(arrival_time=arrival), siblings_pending=params.n > 1)

    def submit(self, request: Request) -> None:
        """Queue a prepared request (engine thread only)."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id!r}",
                                      param="request_id")
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0])

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.runner.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is out of vocabulary "
                                          f"range [0, {vocab})", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return ids

    def _check_lengths(self, num_prompt: int, params: SamplingParams) -> int:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {num_prompt} input tokens. Please reduce the length of the "
                "input messages.", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt
        if num_prompt + max_tokens > limit:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion.", param="max_tokens")
        bm = self.block_manager
        need = blocks_needed(num_prompt + max_tokens - 1, bm.block_size)
        if need > bm.num_blocks:
            raise InvalidRequestError(
                f"the request needs {need} KV cache blocks ({num_prompt} prompt + {max_tokens} "
                f"max_tokens) but the KV cache holds only {bm.num_blocks} blocks of "
                f"{bm.block_size} tokens; reduce max_tokens or the prompt", param="max_tokens")
        return max_tokens

    def _new_seq(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                 max_tokens: int, priority: int, arrival: float) -> Sequence:
        self._next_seq_id += 1
        gen = None
        if params.seed is not None:
            gen = torch.Generator().manual_seed(params.seed + index)
        seq = Sequence(self._next_seq_id, request_id, index, list(ids), len(ids), params,
                       max_tokens, priority, arrival, generator=gen)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params)
        if params.logprobs is not None:
            seq.logprobs, seq.cumulative_logprob = [], 0.0
        return seq

    def abort_request(self, request_id: str) -> None:
        """Finish every sequence of the request as "abort" and free its blocks now."""
        self.abort_with_output(request_id)

    def abort_with_output(self, request_id: str) -> RequestOutput | None:
        """`abort_request`, returning the request's final output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        request.metrics.finished_time = time.time()
        delta = request.params.output_kind is RequestOutputKind.DELTA
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [self._completion(s, delta) for s in request.seqs], True,
                             num_cached_tokens=max(request.seqs[0].num_cached_tokens, 0),
                             metrics=request.metrics)

    # -- the loop -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run, postprocess; returns outputs of requests that progressed."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self._mark_scheduled(chunks)
        logits = self.runner.execute([self._seq_chunk(c) for c in chunks])
        self.scheduler.update_from_output(chunks)
        sampled = [c.seq for c in chunks if c.need_logits]
        results = self.sampler(logits, sampled) if sampled else []
        self._counters["num_steps"] += 1
        touched = self._postprocess(sampled, results)
        return [out for req, changed in touched.items()
                if (out := self._make_output(req, changed)) is not None]

    def _seq_chunk(self, chunk: ScheduledChunk) -> Any:
        seq, start = chunk.seq, chunk.start_pos
        return self._chunk_cls(seq.token_ids[start:start + chunk.num_tokens], start,
                               seq.block_table, chunk.need_logits)

    def _mark_scheduled(self, chunks: list[ScheduledChunk]) -> None:
        now = time.time()
        for chunk in chunks:
            metrics = self.requests[chunk.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now

    def _postprocess(self, seqs: list[Sequence],
                     results: list[SampleResult]) -> dict[Request, set[int]]:
        touched: dict[Request, set[int]] = {}
        for seq, result in zip(seqs, results, strict=True):
            request = self.requests[seq.request_id]
            self._append(seq, result)
            if seq.num_output_tokens == 1:
                self._on_first_token(request, seq)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
            touched.setdefault(request, set()).add(seq.index)
        return touched

    def _on_first_token(self, request: Request, seq: Sequence) -> None:
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = time.time()
        if seq.index == 0:
            self._counters["prompt_tokens"] += seq.num_prompt_tokens
        if request.siblings_pending:  # the prompt's full blocks are cached now
            request.siblings_pending = False
            for sibling in request.seqs[1:]:
                self.scheduler.add(sibling)

    def _append(self, seq: Sequence, result: SampleResult) -> None:
        token = result.token_id
        seq.token_ids.append(token)
        self._counters["generation_tokens"] += 1
        if seq.logprobs is not None and result.top_logprobs is not None:
            seq.logprobs.append(result.top_logprobs)
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + (result.logprob or 0.0)
        self._check_stop(seq, token)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params, detok = seq.params, seq.detokenizer
        assert detok is not None
        may_stop = seq.num_output_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and token in self.tokenizer.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            if params.include_stop_str_in_output:
                detok.add_token(token)
        else:
            stop = detok.add_token(token, check_stop=may_stop)
            if stop is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and (seq.num_output_tokens >= seq.max_tokens
                                          or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"

    # -- outputs ------------------------------------------------------------------
    def _make_output(self, request: Request, changed: set[int]) -> RequestOutput | None:
        finished = request.finished
        kind = request.params.output_kind
        if finished:
            request.metrics.finished_time = time.time()
            self.requests.pop(request.request_id, None)
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        seqs = [s for s in request.seqs if s.index in changed] if delta else request.seqs
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids,
            [self._completion(s, delta) for s in seqs], finished,
            num_cached_tokens=max(request.seqs[0].num_cached_tokens, 0),
            metrics=request.metrics)

    @staticmethod
    def _completion(seq: Sequence, delta: bool) -> CompletionOutput:
        assert seq.detokenizer is not None
        text = seq.detokenizer.output_text(seq.finish_reason is not None)
        tokens = seq.output_token_ids
        logprobs = seq.logprobs
        if delta:
            text, tokens = text[seq.sent_chars:], tokens[seq.sent_tokens:]
            logprobs = logprobs[seq.sent_tokens:] if logprobs is not None else None
            seq.sent_chars += len(text)
            seq.sent_tokens += len(tokens)
        return CompletionOutput(seq.index, text, tokens, seq.cumulative_logprob,
                                logprobs, seq.finish_reason, seq.stop_reason)

    # -- introspection --------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            kv_cache_usage=bm.usage, num_kv_blocks=bm.num_blocks,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            num_preemptions=sched.num_preemptions, **self._counters)

    def drain_kv_events(self) -> list[KVEvent]:
        """KV events since the last call (safe from another thread)."""
        return self.block_manager.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()
