"""Consume a worker's KV events (vLLM's ZMQ PUB format) into the pool's precise index.

One task per publishing worker: a SUB socket connected to its endpoint, every message
`[topic, seq (8 bytes big-endian), msgpack EventBatch]` applied in order:

    BlockStored      -> index.store(worker, hashes, medium)   (confirms predicted entries)
    BlockRemoved     -> index.remove(worker, hashes, medium)
    AllBlocksCleared -> index.clear(worker, tiers=False)     (its pool; tiers stay)

The `medium` (`GPU`/None: the pool; `CPU`, `DISK`: the worker's offload tiers; `REDIS`:
the shared store) picks the part of the index (`prefix_index.TieredKVIndex`).

A sequence number going backwards means the publisher restarted: the worker's entries
are cleared. A gap (PUB drops under pressure) is counted; the index self-heals as later
events and predicted entries expire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from sluice.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    decode_batch,
)
from sluice.router.prefix_index import TieredKVIndex

log = logging.getLogger(__name__)


class KVEventSubscriber:
    """Applies one worker's KV events to `index`. `on_event(type_name)` counts them."""

    def __init__(self, ctx: zmq.asyncio.Context, url: str, endpoint: str, index: TieredKVIndex,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.url = url
        self.endpoint = endpoint
        self.index = index
        self.on_event = on_event or (lambda _t: None)
        self.last_seq: int | None = None
        self.gaps = 0
        self.block_size_seen: int | None = None
        self._socket = ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)

    async def run(self) -> None:
        """Receive and apply batches until cancelled; closes the socket on the way out."""
        try:
            while True:
                frames = await self._socket.recv_multipart()
                self.handle(frames)
        except asyncio.CancelledError:
            raise
        finally:
            self._socket.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            log.warning("KV event from %s with %d frames ignored", self.url, len(frames))
            return
        self._check_seq(int.from_bytes(frames[1], "big"))
        try:
            batch = decode_batch(frames[2])
        except (ValueError, TypeError, IndexError) as exc:
            log.warning("undecodable KV event batch from %s: %s", self.url, exc)
            return
        self.apply(batch)

    def _check_seq(self, seq: int) -> None:
        if self.last_seq is not None and seq <= self.last_seq:
            self.index.clear(self.url)  # publisher restarted
        elif self.last_seq is not None and seq > self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.block_size_seen = ev.block_size
            apply_event(self.index, self.url, ev)
            self.on_event(type(ev).__name__)


def apply_event(index: TieredKVIndex, url: str, ev: KVEvent) -> None:
    """What one KV event from worker `url` does to the precise index (the simulator,
    which has no sockets, calls this too)."""
    if isinstance(ev, BlockStored):
        index.store(url, ev.block_hashes, medium=ev.medium)
    elif isinstance(ev, BlockRemoved):
        index.remove(url, ev.block_hashes, medium=ev.medium)
    elif isinstance(ev, AllBlocksCleared):
        index.clear(url, tiers=False)
