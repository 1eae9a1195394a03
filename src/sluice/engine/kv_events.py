"""Publish the engine's KV cache events the way vLLM does, so KV-aware routers can read them.

`KVEventPublisher(endpoint)` binds a ZMQ PUB socket (vLLM's `ZmqEventPublisher`
default: the worker binds, routers connect) and sends each batch as three frames:

    [topic, sequence number (8 bytes, big-endian), msgpack EventBatch]

encoded by `sluice.protocol.kv_events.encode_batch`. PUB never blocks: with no
subscriber, or a slow one past the high-water mark, messages are dropped, and the
sequence number lets a subscriber notice. Not thread-safe: call from one thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from sluice.protocol.kv_events import EventBatch, KVEvent, encode_batch


class KVEventPublisher:
    def __init__(self, endpoint: str, topic: str = "", data_parallel_rank: int | None = None,
                 context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 100_000)
        self._socket.bind(endpoint)
        self._seq = 0

    @property
    def seq(self) -> int:
        """Sequence number of the last batch sent (0 before the first)."""
        return self._seq

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send `events` as one batch; an empty list sends nothing."""
        if not events:
            return
        self._seq += 1
        payload = encode_batch(EventBatch(time.time(), list(events), self._rank))
        self._socket.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload],
                                    flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._socket.close(linger=0)
        if self._own_ctx:
            self._ctx.term()
