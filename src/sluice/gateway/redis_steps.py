"""Limiter calls batched into steps: one script call per step, at most two in flight.

Every admitted request costs the Redis limiter two script calls (acquire, finish), each
a round trip through redis-py and a connection from its pool: at a few hundred req/s
that was 30% of a gateway's samples, 14 of them waiting in the pool (docs/router.md,
issue 11). Here the calls that arrive while earlier ones travel are sent together:

    callers ──submit(op)──▶ queue ──step: EVALSHA sha 0 '{"ops": [op, op, ...]}'──▶ Redis
                                         (one connection; step k+1 is written while
    callers ◀──one reply per op── replies ◀── step k's reply is on its way: 2 in flight)

Exactness is the script's: Redis runs one script call atomically and applies its ops
in list order, so each limit is checked and charged as if the calls had come one by
one, in the order they arrived (steps on one connection run in the order sent). A
step is the whole queue (up to `max_ops`), sent on the next turn of the event loop, so
the calls of one turn share a step; while two steps are in flight the queue grows.

A step that fails (the connection broke, a timeout, the script unknown after a SCRIPT
FLUSH) fails all its ops and every step behind it with `LimiterUnavailableError`; the
connection is dropped and the next step opens a new one (and loads the script). Some of
those ops may have run: the limiter decides what to do about it (limits.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Callable
from typing import Any

MAX_OPS = 256  # one script call holds Redis for its ops; bound the pause
DEPTH = 2  # steps in flight


_Op = tuple[list[Any], "asyncio.Future[Any]"]


class RedisSteps:
    """Owns one Redis connection (taken from `pool`) and the ops waiting for a step.
    `submit` and everything here run on one event loop (a new loop starts afresh)."""

    def __init__(self, pool: Any, script: str, header: dict[str, Any], *,
                 on_step: Callable[[BaseException | None], None] = lambda _: None,
                 error: Callable[[BaseException], Exception] = RuntimeError,
                 max_ops: int = MAX_OPS, depth: int = DEPTH) -> None:
        self.pool = pool
        self.script = script
        self.header = header  # sent with every step (prefix, window, lease)
        self.on_step = on_step  # after every step: None, or the error that failed it
        self.error = error  # what a failed step's ops raise, from redis-py's error
        self.max_ops = max_ops
        self.depth = depth
        self.steps_sent = 0
        self.most_in_flight = 0
        self._sha = ""
        self._conn: Any = None
        self._queue: list[_Op] = []
        self._in_flight: deque[list[_Op]] = deque()
        self._sending = False
        self._reader: asyncio.Task[None] | None = None
        self._reading: Any = None  # the connection `_reader` reads
        self._loop: asyncio.AbstractEventLoop | None = None

    def submit(self, op: list[Any]) -> asyncio.Future[Any]:
        """Queue `op`; the future gets the script's answer for it, or `error(...)`."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new loop: nothing of the old one carries over
            self._loop, self._conn, self._sending = loop, None, False
            self._in_flight.clear()
            self._queue.clear()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((op, future))
        self._kick()
        return future

    def _kick(self) -> None:
        if self._queue and not self._sending and len(self._in_flight) < self.depth:
            self._sending = True
            asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        """Write one step: the whole queue, up to `max_ops` (the calls of this loop turn)."""
        step, self._queue = self._queue[: self.max_ops], self._queue[self.max_ops:]
        self._in_flight.append(step)
        self.most_in_flight = max(self.most_in_flight, len(self._in_flight))
        payload = json.dumps({**self.header, "ops": [op for op, _ in step]})
        try:
            conn = await self._connection()
            await conn.send_command("EVALSHA", self._sha, 0, payload, check_health=False)
        except Exception as exc:
            await self._fail(exc)
        else:
            self.steps_sent += 1
            if self._reader is None or self._reader.done() or self._reading is not conn:
                self._reading = conn
                self._reader = asyncio.get_running_loop().create_task(self._read(conn))
        finally:
            self._sending = False
        self._kick()

    async def _read(self, conn: Any) -> None:
        """Answer the steps in flight on `conn` in the order they were sent (Redis
        replies so); stops once `conn` is dropped (its steps were failed then)."""
        while self._in_flight and conn is self._conn:
            try:
                reply = await conn.read_response()
            except Exception as exc:
                if conn is self._conn:
                    await self._fail(exc)
                return
            if conn is not self._conn:
                return
            step = self._in_flight.popleft()
            for (_, future), answer in zip(step, json.loads(reply), strict=True):
                if not future.done():
                    future.set_result(answer)
            self.on_step(None)
            self._kick()

    async def _connection(self) -> Any:
        if self._conn is None:
            conn = await self.pool.get_connection("EVALSHA")
            try:
                await conn.send_command("SCRIPT", "LOAD", self.script, check_health=False)
                sha = await conn.read_response()
            except BaseException:
                await self.pool.release(conn)
                raise
            self._conn, self._sha = conn, sha.decode() if isinstance(sha, bytes) else sha
        return self._conn

    async def _fail(self, exc: BaseException) -> None:
        """Fail every step in flight and drop the connection (its replies are lost)."""
        conn, self._conn = self._conn, None
        error = self.error(exc)
        error.__cause__ = exc
        while self._in_flight:
            for _, future in self._in_flight.popleft():
                if not future.done():
                    future.set_exception(error)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)
            with contextlib.suppress(Exception):
                await self.pool.release(conn)
        self.on_step(exc)
        self._kick()  # what queued behind the failed steps goes in a new one

    async def close(self) -> None:
        """Fail what is queued or in flight, and close the connection."""
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        error = self.error(ConnectionError("limiter closed"))
        for step in (*self._in_flight, self._queue):
            for _, future in step:
                if not future.done():
                    future.set_exception(error)
        self._in_flight.clear()
        self._queue = []
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(Exception):
                await self.pool.release(conn)
        await self.pool.disconnect()
