"""The front end's half of the engine: token updates in, `RequestOutput`s out.

    core.step() ──► [SeqUpdate] ──► OutputProcessor.process()
                                      detokenize each new token (IncrementalDetokenizer)
                                      stop strings ──► finished here, core.finish() later
                                      output kind: CUMULATIVE | DELTA | FINAL_ONLY
                                  ──► [RequestOutput], [(request_id, index) to stop]

It holds, per request, what only text needs: detokenizer state, text and tokens
already handed out, logprobs so far. The core never sees text, so this runs in the
HTTP process while the core process computes the next step (vLLM V1's split). A
sequence stopped by a stop string is finished here at once; the core hears of it one
message later and may have computed a token more, which is dropped.

No torch: importable by a front end that never loads the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.detokenizer import Decoder, IncrementalDetokenizer
from sluice.engine.messages import SeqUpdate
from sluice.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from sluice.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _SeqText:
    """One completion's front-end state."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_chars: int = 0  # text / tokens already handed out (DELTA outputs)
    sent_tokens: int = 0
    num_preemptions: int = 0
    prediction: tuple[int, int] = (0, 0)  # accepted, rejected (SeqUpdate's, cumulative)

    def completion(self, delta: bool) -> CompletionOutput:
        text = self.detokenizer.output_text(self.finish_reason is not None)
        tokens, logprobs = self.token_ids, self.logprobs
        if delta:
            text, tokens = text[self.sent_chars:], tokens[self.sent_tokens:]
            logprobs = logprobs[self.sent_tokens:] if logprobs is not None else None
            self.sent_chars += len(text)
            self.sent_tokens += len(tokens)
        else:
            tokens = list(tokens)
        return CompletionOutput(self.index, text, tokens, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason, *self.prediction)


@dataclass
class _RequestText:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_SeqText]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # a P/D prefill's, once finished
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once the core sent them
    prompt_logprobs_sent: bool = False  # (DELTA outputs carry them once)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


class OutputProcessor:
    """Turns the core's token updates into outputs; one per front end, not thread-safe."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestText] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float, num_resumed: int = 0) -> None:
        """`num_resumed`: the last ids of `prompt_token_ids` were generated before (a
        migrated request): they are detokenized here as if just generated, and what that
        text is counted as already sent, so the new text continues it exactly (the same
        detokenizer state and stop-string hold-back as on the worker that sent it)."""
        split = len(prompt_token_ids) - num_resumed
        prompt_ids, resumed = prompt_token_ids[:split], prompt_token_ids[split:]
        seqs = [_SeqText(i, IncrementalDetokenizer(self.tokenizer, prompt_ids, params),
                         logprobs=[] if params.logprobs is not None else None,
                         cumulative_logprob=0.0 if params.logprobs is not None else None)
                for i in range(params.n)]
        for seq in seqs:
            if resumed:
                self._replay(seq, params, resumed)
        self.requests[request_id] = _RequestText(request_id, prompt, prompt_ids, params,
                                                 seqs, RequestMetrics(arrival_time=arrival_time))

    def _replay(self, seq: _SeqText, params: SamplingParams, resumed: list[int]) -> None:
        update = SeqUpdate("", seq.index, [])
        for token in resumed:
            seq.token_ids.append(token)
            self._add_text(seq, params, token, update, last=False)
        seq.sent_chars = len(seq.detokenizer.output_text(False))
        seq.sent_tokens = len(resumed)

    def process(self, updates: list[SeqUpdate]
                ) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one step's updates; returns the outputs and the sequences the core must
        stop (their text reached a stop string)."""
        touched: dict[str, set[int]] = {}
        to_stop: list[tuple[str, int]] = []
        for update in updates:
            request = self.requests.get(update.request_id)
            if request is None:  # aborted, or stopped here before the core heard
                continue
            seq = request.seqs[update.index]
            if seq.finish_reason is not None:
                continue
            if self._apply(request, seq, update):
                to_stop.append((request.request_id, seq.index))
            touched.setdefault(request.request_id, set()).add(seq.index)
        outputs = [out for rid, changed in touched.items()
                   if (out := self._output(self.requests[rid], changed)) is not None]
        return outputs, to_stop

    def _apply(self, request: _RequestText, seq: _SeqText, update: SeqUpdate) -> bool:
        """Append the update's tokens; True if a stop string ended the sequence here."""
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.time()
            metrics.first_scheduled_time = update.scheduled_time
        request.num_cached_tokens = update.num_cached_tokens
        if update.kv_transfer_params is not None:
            request.kv_transfer_params = update.kv_transfer_params
        if update.prompt_logprobs is not None:
            request.prompt_logprobs = update.prompt_logprobs
        metrics.num_prefill_chunks = update.num_prefill_chunks
        seq.num_preemptions = update.num_preemptions
        seq.prediction = (update.accepted_prediction_tokens, update.rejected_prediction_tokens)
        seq.token_ids += update.new_token_ids
        if seq.logprobs is not None and update.new_logprobs is not None:
            seq.logprobs += update.new_logprobs
            seq.cumulative_logprob = update.cumulative_logprob
        params = request.params
        last = len(update.new_token_ids) - 1
        for i, token in enumerate(update.new_token_ids):
            if self._add_text(seq, params, token, update, last=i == last):
                if i < last:  # several tokens (a verified draft): drop those after the stop
                    self._drop_after_stop(seq, update, last - i)
                return True
        seq.finish_reason, seq.stop_reason = update.finish_reason, update.stop_reason
        return False

    @staticmethod
    def _drop_after_stop(seq: _SeqText, update: SeqUpdate, count: int) -> None:
        """The last `count` tokens came after a stop string: plain decoding never made them."""
        dropped = seq.token_ids[-count:]
        del seq.token_ids[-count:]
        if seq.logprobs is not None and update.new_logprobs is not None:
            gone = seq.logprobs[-count:]
            del seq.logprobs[-count:]
            if seq.cumulative_logprob is not None:
                seq.cumulative_logprob -= sum(lp.get(t, 0.0) for t, lp in
                                              zip(dropped, gone, strict=True))

    @staticmethod
    def _add_text(seq: _SeqText, params: SamplingParams, token: int, update: SeqUpdate,
                  last: bool) -> bool:
        stopped_by_token = last and update.finish_reason == "stop"
        if stopped_by_token:  # end-of-sequence (no text) or a stop token id
            if update.stop_reason is not None and params.include_stop_str_in_output:
                seq.detokenizer.add_token(token, check_stop=False)
            return False
        may_stop = len(seq.token_ids) >= params.min_tokens
        stop = seq.detokenizer.add_token(token, check_stop=may_stop)
        if stop is None:
            return False
        seq.finish_reason, seq.stop_reason = "stop", stop
        return True

    def _output(self, request: _RequestText, changed: set[int]) -> RequestOutput | None:
        finished = request.finished
        kind = request.params.output_kind
        if finished:
            request.metrics.finished_time = time.time()
            request.metrics.num_preemptions = sum(s.num_preemptions for s in request.seqs)
            del self.requests[request.request_id]
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind is RequestOutputKind.DELTA
        seqs = [s for s in request.seqs if s.index in changed] if delta else request.seqs
        return self._make(request, seqs, delta, finished)

    @staticmethod
    def _make(request: _RequestText, seqs: list[_SeqText], delta: bool,
              finished: bool) -> RequestOutput:
        prompt_logprobs = request.prompt_logprobs
        if delta and prompt_logprobs is not None:
            if request.prompt_logprobs_sent:
                prompt_logprobs = None
            request.prompt_logprobs_sent = True
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             [s.completion(delta) for s in seqs], finished,
                             num_cached_tokens=request.num_cached_tokens,
                             metrics=request.metrics,
                             kv_transfer_params=request.kv_transfer_params,
                             prompt_logprobs=prompt_logprobs)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget the request; its final output, every unfinished sequence "abort"."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
        request.metrics.finished_time = time.time()
        delta = request.params.output_kind is RequestOutputKind.DELTA
        return self._make(request, request.seqs, delta, True)

    def has_unfinished(self) -> bool:
        return bool(self.requests)
