"""What the front end and the engine core say to each other, and its wire form.

    front end ──► core   Add(CoreRequest) | Abort(request_id) | Finish(request_id, index)
                         | Shutdown
    core ──► front end   Ready(CoreInfo) | Failed(message, param) | CoreOutputs(updates, stats, errors)

One `CoreOutputs` per engine step carries every sequence's new tokens, so the IPC
cost is one small message per step, not one per token per stream. On a thread the
objects pass as they are; between processes `encode` / `decode` turn them into
msgpack (plain lists and dicts: no pickle, so a message from a dead or foreign peer
cannot run code). No torch here: the HTTP front end imports this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack

from sluice.engine.lora import LoRARequest
from sluice.engine.outputs import TokenLogprobs
from sluice.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from sluice.engine.stats import EngineStats
from sluice.protocol.errors import InvalidRequestError, ServiceUnavailableError, SluiceError


@dataclass(frozen=True, slots=True)
class CoreRequest:
    """A request as the core takes it: already tokenized and validated by the front end."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    max_tokens: int = 1  # effective: params.max_tokens, or up to the context length
    num_output_tokens: int = 0  # trailing prompt_token_ids already generated (a migrated
    #                             request resumed here: they count as output, not prompt)
    lora: LoRARequest | None = None  # multi-LoRA: the adapter to run with (None: the base)
    # an embedding (`/v1/embeddings`, `LLM.embed`): the prompt is computed and nothing is
    # sampled; its pooled final hidden states come back in `SeqUpdate.embedding`
    pooling: bool = False
    use_activation: bool | None = None  # a pooling request's (PoolingParams'; None: default)
    pooling_type: str = ""  # "ALL" for a token task (every token's row); "": the model's


@dataclass(slots=True)
class SeqUpdate:
    """What one sequence gained in one step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    scheduled_time: float | None = None  # when the request was first scheduled
    num_preemptions: int = 0  # of this sequence so far
    num_prefill_chunks: int = 0  # chunks its prompt took before the first token
    # a finished do_remote_decode prefill: where its held KV is (vLLM's response params)
    kv_transfer_params: dict[str, Any] | None = None
    # prompt_logprobs: every prompt position's entry (None first), with the first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # a pooling request's answer: the L2-normalized vector as little-endian float32 bytes
    # (what `encoding_format: base64` sends as it is)
    embedding: bytes | None = None
    # SamplingParams.prediction: the sequence's drafted prediction tokens accepted and
    # refused so far (cumulative)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What a front end must know about its core (sent once, when the model is loaded)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    structured_outputs_backend: str = "auto"  # the front end checks constraints for it
    # multi-LoRA: the front end checks adapters against these before using them
    enable_lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    num_layers: int = 0
    lora_shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # (in, out)
    scheduling_policy: str = "priority"  # under fcfs the front end refuses a priority
    # a reasoning model's: its constrained outputs' grammar starts after the thinking, so
    # the front end hands their thinking out as reasoning too
    reasoning_parser: str = ""
    # an embedding's width, and the sizes `dimensions` may cut it to (LlamaConfig's)
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] | None = None
    # a pooling model's core (an encoder, or a classifier): no generation
    embedding_only: bool = False
    # ... and a classifier's label names: an "embedding" is its labels' scores (one label:
    # a cross-encoder, one pair's score on /v1/score and /v1/rerank)
    labels: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Add:
    request: CoreRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class Finish:
    request_id: str
    index: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = Add | Abort | Finish | Shutdown


@dataclass(frozen=True, slots=True)
class Ready:
    info: CoreInfo


@dataclass(frozen=True, slots=True)
class Failed:
    message: str
    param: str | None = None  # the setting it names (an InvalidRequestError's), if any


@dataclass(slots=True)
class CoreOutputs:
    """One step's results: token updates, the engine's stats after it, failed requests."""

    updates: list[SeqUpdate]
    stats: EngineStats
    errors: list[tuple[str, SluiceError]] = dataclasses.field(default_factory=list)


Event = Ready | Failed | CoreOutputs


# --------------------------------------------------------------------------- wire


def encode(message: Command | Event) -> bytes:
    return msgpack.packb(_to_wire(message), use_bin_type=True)


def decode(data: bytes) -> Command | Event:
    return _from_wire(msgpack.unpackb(data, raw=False, strict_map_key=False))


def _to_wire(m: Command | Event) -> list[Any]:
    if isinstance(m, CoreOutputs):
        return ["out", [dataclasses.astuple(u) for u in m.updates],
                dataclasses.astuple(m.stats),
                [[rid, e.status_code, e.message, e.param, e.code] for rid, e in m.errors]]
    if isinstance(m, Add):
        r = m.request
        lora = None if r.lora is None else [r.lora.lora_name, r.lora.lora_path,
                                             r.lora.content_hash]
        return ["add", r.request_id, r.prompt_token_ids, _params_to_wire(r.params), r.priority,
                r.arrival_time, r.max_tokens, r.num_output_tokens, lora, r.pooling,
                r.use_activation, r.pooling_type]
    if isinstance(m, Abort):
        return ["abort", m.request_id]
    if isinstance(m, Finish):
        return ["finish", m.request_id, m.index]
    if isinstance(m, Ready):
        return ["ready", *dataclasses.astuple(m.info)]
    if isinstance(m, Failed):
        return ["failed", m.message, m.param]
    return ["shutdown"]


def _from_wire(w: list[Any]) -> Command | Event:
    kind, args = w[0], w[1:]
    if kind == "out":
        updates, stats, errors = args
        return CoreOutputs([SeqUpdate(*u) for u in updates], EngineStats(*stats),
                           [(rid, _error(*e)) for rid, *e in errors])
    if kind == "add":
        rid, ids, params, priority, arrival, max_tokens, num_output, lora, *pooling = args
        return Add(CoreRequest(rid, ids, _params_from_wire(params), priority, arrival, max_tokens,
                               num_output, None if lora is None else LoRARequest(*lora),
                               *pooling))
    if kind == "abort":
        return Abort(args[0])
    if kind == "finish":
        return Finish(args[0], args[1])
    if kind == "ready":
        info = CoreInfo(*args)  # (msgpack gives lists: the tuples back)
        dims = info.matryoshka_dimensions
        return Ready(dataclasses.replace(info, labels=tuple(info.labels),
                                         matryoshka_dimensions=None if dims is None
                                         else tuple(dims)))
    if kind == "failed":
        return Failed(*args)
    if kind == "shutdown":
        return Shutdown()
    raise ValueError(f"unknown engine message {kind!r}")


def _params_to_wire(p: SamplingParams) -> dict[str, Any]:
    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    d["output_kind"] = p.output_kind.value
    if p.structured_outputs is not None:
        d["structured_outputs"] = p.structured_outputs.to_dict()
    return d


def _params_from_wire(d: dict[str, Any]) -> SamplingParams:
    so = d.get("structured_outputs")
    return SamplingParams(**{**d, "output_kind": RequestOutputKind(d["output_kind"]),
                             "structured_outputs": StructuredOutputsParams.from_dict(so)
                             if so is not None else None})


def _error(status: int, message: str, param: str | None, code: str | None = None
           ) -> SluiceError:
    if status == 400:
        return InvalidRequestError(message, param=param, code=code)
    if status == 503:  # e.g. a KV transfer that failed under kv_load_failure_policy=fail
        return ServiceUnavailableError(message, param=param, code=code)
    return SluiceError(message, param=param, code=code)
