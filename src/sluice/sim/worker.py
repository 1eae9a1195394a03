"""A simulated worker: the production `Scheduler` and `BlockManager`, a modelled forward pass.

One worker's engine loop in virtual time, the same three verbs as `EngineCore.step`:

    chunks = scheduler.schedule()               real: admission, prefix-cache hits,
                                                chunked prefill, preemption, priorities
    (virtual) now += profile.step_seconds(chunks)   the forward pass, as a duration
    scheduler.update_from_output(chunks)        real: computed tokens, full blocks cached
    one token per chunk that reached its end    stop at max_tokens; free when finished

The block manager's KV events (`BlockStored` / `BlockRemoved`) are handed to the
router's index as a real worker publishes them. Generated token ids are a pure function
of the request's `token_seed` and the position, so a multi-turn session's next prompt (which carries the
answer) is reproducible. Stopping is by length only (as a benchmark with `ignore_eos`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import SchedulerConfig
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledChunk, Scheduler
from sluice.engine.sequence import Sequence
from sluice.protocol.kv_events import KVEvent
from sluice.sim.loop import EventLoop
from sluice.sim.planner import WorkerLatency
from sluice.sim.profile import StepProfile

TOKEN_SPACE = 32_000  # generated ids are drawn from [0, TOKEN_SPACE)
_PARAMS = SamplingParams(max_tokens=None, ignore_eos=True)  # read by nobody in the sim


@dataclass(eq=False)
class SimRequest:
    """One request's life in the simulator; its hooks tell the cluster what happened."""

    request_id: str
    # the prompt's ids; the worker's engine sequence takes this very list as its
    # `token_ids` (no copy of a ~15k-token prompt), so once added it grows by the answer
    prompt: list[int]
    max_tokens: int
    arrival: float  # when the client sent it
    priority: int = 0
    token_seed: int = 0  # generated ids are a function of this and the position
    session_key: str | None = None
    on_first_token: Callable[[SimRequest, float], None] | None = None
    on_finish: Callable[[SimRequest], None] | None = None
    token_times: list[float] = field(default_factory=list)  # engine time of each token
    output: list[int] = field(default_factory=list)  # the generated ids, once finished
    worker: str = ""
    num_cached_tokens: int = 0
    error: str | None = None
    meta: object = None  # the cluster's own per-request state (router ticket, record)
    # the prompt's full blocks' chained hashes, as the router computed them: the engine
    # takes them instead of hashing the same blocks again (`Sequence.known_block_hashes`)
    block_hashes: tuple[int, ...] = ()
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt)


class SimWorker:
    """One engine. Owns its scheduler and block manager; driven by the event loop."""

    def __init__(self, url: str, profile: StepProfile, loop: EventLoop,
                 on_kv_events: Callable[[str, list[KVEvent]], None], changed: set[str],
                 scheduling_policy: str = "priority", latency: WorkerLatency | None = None,
                 host: list[int] | None = None) -> None:
        """`changed`: the cluster's set of workers whose gauges moved since the router's
        last scrape; this worker adds its url on every change. `latency`: what its
        /metrics would export; every inter-token latency goes there."""
        self.url = url
        self.latency = latency if latency is not None else WorkerLatency()
        # [busy workers] on this worker's host, shared by them (profile.host_contention)
        self.host = host if host is not None else [0]
        self.profile = profile
        self.loop = loop
        self.on_kv_events = on_kv_events
        self.block_manager = BlockManager(profile.num_kv_blocks, profile.block_size, True)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            scheduling_policy=scheduling_policy), self.block_manager)
        self.requests: dict[Sequence, SimRequest] = {}
        self.busy = False
        self.changed = changed
        changed.add(url)
        self.busy_seconds = 0.0
        self.num_steps = 0
        self.num_requests = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._next_seq_id = 0
        self._end = self._end_step  # bound once (once per step otherwise)

    # -- what the router scrapes -------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def idle(self) -> bool:
        return not self.requests

    # -- admission ---------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """Queue `req` (as `EngineCore.add`); starts a step if the engine was idle."""
        self._next_seq_id += 1
        seq = Sequence(self._next_seq_id, req.request_id, 0, req.prompt, req.num_prompt_tokens,
                       _PARAMS, req.max_tokens, req.priority, self.loop.now,
                       known_block_hashes=req.block_hashes)
        self.requests[seq] = req
        req.worker = self.url
        self.num_requests += 1
        self.changed.add(self.url)
        self.scheduler.add(seq)
        if not self.busy:
            self._start_step()

    # -- the loop ----------------------------------------------------------------------
    def _start_step(self) -> None:
        while True:
            chunks = self.scheduler.schedule()
            if chunks:
                if not self.busy:
                    self.busy = True
                    self.host[0] += 1
                profile = self.profile
                seconds = profile.step_seconds(chunks)
                if profile.host_contention:
                    seconds *= 1.0 + profile.host_contention * (self.host[0] - 1)
                self.busy_seconds += seconds
                self.loop.after(seconds, self._end, chunks)
                return
            if self.busy:
                self.busy = False
                self.host[0] -= 1
            if not self.scheduler.waiting:
                return
            self._reject_head()

    def _end_step(self, chunks: list[ScheduledChunk]) -> None:
        """The step's tokens are computed: one token for each chunk that reached its
        sequence's end (one call per step, the token bookkeeping inline: most steps
        decode one or a few sequences)."""
        self.scheduler.update_from_output(chunks)
        self.num_steps += 1
        self.changed.add(self.url)
        now, requests, latency = self.loop.now, self.requests, self.latency
        # WorkerLatency.observe_itl, spelled out: summed here in token order (the same
        # float) and stored once; the hooks below never read it
        itl_sum, itl_count = latency.itl_sum, latency.itl_count
        for chunk in chunks:
            if not chunk.need_logits:
                continue
            seq = chunk.seq
            req = requests[seq]
            token_ids, times = seq.token_ids, req.token_times
            # the answer is `token_ids` past the prompt (req.output, set at the finish)
            token_ids.append((req.token_seed * 7919 + len(token_ids) * 104_729) % TOKEN_SPACE)
            if times:
                itl_sum += now - times[-1]
                itl_count += 1
                times.append(now)
            else:
                self._first_token(seq, req, now)
            if len(times) >= seq.max_tokens:  # seq.num_output_tokens: one time per token
                seq.finish_reason = "length"
                self._finish(seq, req)
        self.generation_tokens += itl_count - latency.itl_count  # one per token: the
        latency.itl_sum, latency.itl_count = itl_sum, itl_count  # first ones below
        if self.block_manager.events:
            self.on_kv_events(self.url, self.block_manager.drain_events())
        self._start_step()

    def _first_token(self, seq: Sequence, req: SimRequest, now: float) -> None:
        req.token_times.append(now)
        self.generation_tokens += 1
        self.prompt_tokens += seq.num_prompt_tokens
        req.num_cached_tokens = max(seq.num_cached_tokens, 0)
        if req.on_first_token is not None:
            req.on_first_token(req, now)

    def _finish(self, seq: Sequence, req: SimRequest) -> None:
        req.output = seq.token_ids[seq.num_prompt_tokens:]
        self.scheduler.finish(seq)
        del self.requests[seq]
        if req.on_finish is not None:
            req.on_finish(req)

    def _reject_head(self) -> None:
        """Nothing could be scheduled while requests wait: the head needs more KV blocks
        than the whole pool has (a real worker rejects such a prompt up front)."""
        seq = self.scheduler.waiting[0]
        req = self.requests[seq]
        req.error = "kv_capacity"
        self._finish(seq, req)
