"""KV cache events in vLLM's wire format, so routers built for vLLM can read sluice's.

vLLM publishes, over a ZMQ PUB socket, msgpack-encoded `EventBatch` messages
(multipart: topic, 8-byte big-endian sequence number, payload). Each event is a msgpack
array tagged by its class name, as msgspec's `array_like=True, tag=True` encodes it:

    EventBatch        = [ts: float, events: list, data_parallel_rank: int | None]
    BlockStored       = ["BlockStored", block_hashes, parent_block_hash, token_ids,
                         block_size, lora_id, medium]
    BlockRemoved      = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared  = ["AllBlocksCleared"]

The engine produces these dataclasses (see `sluice.engine` block manager); the worker
encodes and publishes them; the router decodes and indexes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _encode_event(ev: KVEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                ev.block_size, ev.lora_id, ev.medium]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", ev.block_hashes, ev.medium]
    return ["AllBlocksCleared"]


def _decode_event(raw: list[Any]) -> KVEvent:
    tag = raw[0]
    if tag == "BlockStored":
        return BlockStored(list(raw[1]), raw[2], list(raw[3]), int(raw[4]),
                           raw[5] if len(raw) > 5 else None, raw[6] if len(raw) > 6 else None)
    if tag == "BlockRemoved":
        return BlockRemoved(list(raw[1]), raw[2] if len(raw) > 2 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event tag {tag!r}")


def encode_batch(batch: EventBatch) -> bytes:
    return msgpack.packb([batch.ts, [_encode_event(e) for e in batch.events],
                          batch.data_parallel_rank])


def decode_batch(payload: bytes) -> EventBatch:
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return EventBatch(float(raw[0]), [_decode_event(e) for e in raw[1]],
                      raw[2] if len(raw) > 2 else None)
