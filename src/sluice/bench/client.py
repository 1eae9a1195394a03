"""A streaming OpenAI client that times every token: the benchmark's only contact with a server.

One injected `httpx.AsyncClient`; one POST per turn with `stream: true` and
`stream_options.include_usage`, so token counts come from the server's own usage chunk.
Timings use `time.perf_counter()` and are kept raw in `RequestRecord`:

    send ──── TTFT ───► chunk₁ ─ ITL₁ ─► chunk₂ ─ ITL₂ ─► … chunkₙ ──► [DONE]   (E2E = send→[DONE])
    TPOT = (E2E − TTFT) / (output_tokens − 1)     (vLLM's definition: excludes the first token)

Prompt shapes, by endpoint (a registry, `ENDPOINTS`):

- `/v1/completions`: token ids (`prompt: list[int]`) when every segment's ids are known
  (synthetic and trace workloads: exact prompt lengths), otherwise text;
- `/v1/chat/completions`: text messages (system, then user/assistant history);
- `/v1/embeddings` (vLLM's `openai-embeddings` backend; also for `/classify`): the
  completion's prompt as `input`, not streamed: the whole answer is its first "token"
  (TTFT = E2E, no output tokens), so throughput is requests and input tokens a second.
A multi-turn session resends its history with the server's earlier answers as text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.bench.workloads import Segment, Session, Turn
from sluice.protocol.errors import InvalidRequestError

History = list[tuple[Segment, str]]  # (user segment, assistant answer) of earlier turns


@dataclass
class RequestRecord:
    """What one request did, in seconds; `start` and `token_times` are offsets from t0."""

    session: int
    turn: int
    start: float
    expected_prompt_tokens: int
    max_tokens: int
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    text: str = ""
    request_id: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "session": self.session,
            "turn": self.turn,
            "start": self.start,
            "ok": self.ok,
            "error": self.error,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "max_tokens": self.max_tokens,
            "ttft": self.ttft,
            "tpot": self.tpot,
            "e2e": self.e2e,
            "itls": self.itls,
        }


# ---------------------------------------------------------------- endpoint shapes


def _completion_prompt(session: Session, history: History, turn: Turn) -> list[int] | str:
    parts = ([session.system] if session.system else []) + [turn.user]
    if not history and all(p.ids is not None for p in parts):
        return [t for p in parts for t in (p.ids or ())]
    text = session.system.text if session.system else ""
    for user, answer in history:
        text += user.text + answer
    return text + turn.user.text


def _completion_delta(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    return str(choices[0].get("text") or "") if choices else ""


def _chat_messages(session: Session, history: History, turn: Turn) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": session.system.text.strip()}] if session.system else []
    for user, answer in history:
        msgs += [{"role": "user", "content": user.text.strip()}, {"role": "assistant", "content": answer}]
    return msgs + [{"role": "user", "content": turn.user.text.strip()}]


def _chat_delta(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    return str((choices[0].get("delta") or {}).get("content") or "") if choices else ""


@dataclass(frozen=True)
class EndpointShape:
    """How a turn becomes a request body, and where a chunk keeps its new text (None:
    not streamed, one JSON answer)."""

    body: Callable[[Session, History, Turn], dict[str, Any]]
    delta: Callable[[dict[str, Any]], str] | None


ENDPOINTS: dict[str, EndpointShape] = {
    "completions": EndpointShape(
        lambda s, h, t: {"prompt": _completion_prompt(s, h, t)}, _completion_delta
    ),
    "chat": EndpointShape(lambda s, h, t: {"messages": _chat_messages(s, h, t)}, _chat_delta),
    "embeddings": EndpointShape(lambda s, h, t: {"input": _completion_prompt(s, h, t)}, None),
}


def endpoint_kind(path: str) -> str:
    """`/v1/chat/completions` → "chat", `/v1/completions` → "completions",
    `/v1/embeddings` and `/classify` → "embeddings" (a pooled answer, not streamed)."""
    p = path.rstrip("/")
    if p.endswith("/chat/completions"):
        return "chat"
    if p.endswith("/completions"):
        return "completions"
    if p.endswith(("/embeddings", "/classify")):
        return "embeddings"
    raise InvalidRequestError(
        f"--endpoint must end in /completions, /chat/completions, /embeddings or /classify, "
        f"not {path!r}", param="endpoint")


# ---------------------------------------------------------------- the client


@dataclass(frozen=True)
class ClientOptions:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    session_header: bool = False
    request_id_prefix: str = "bench-"  # X-Request-Id = prefix + "<session>-<turn>"


class StreamingClient:
    """Sends turns to one endpoint and times their streams. Holds no state between calls."""

    def __init__(self, http: httpx.AsyncClient, opts: ClientOptions) -> None:
        self.http = http
        self.opts = opts
        self.url = opts.base_url.rstrip("/") + "/" + opts.endpoint.lstrip("/")
        self.shape = ENDPOINTS[endpoint_kind(opts.endpoint)]

    def body(self, session: Session, history: History, turn: Turn) -> dict[str, Any]:
        if self.shape.delta is None:  # pooled: no tokens to generate or sample
            return {"model": self.opts.model, **self.shape.body(session, history, turn)}
        body: dict[str, Any] = {
            "model": self.opts.model,
            **self.shape.body(session, history, turn),
            "max_tokens": turn.output_len,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.opts.ignore_eos:
            body["ignore_eos"] = True
        if self.opts.temperature is not None:
            body["temperature"] = self.opts.temperature
        return body

    def request_id(self, session: Session, turn_index: int) -> str:
        return f"{self.opts.request_id_prefix}{session.index}-{turn_index}"

    def headers(self, session: Session, turn_index: int) -> dict[str, str]:
        h = {"X-Request-Id": self.request_id(session, turn_index)}
        if self.opts.api_key:
            h["Authorization"] = f"Bearer {self.opts.api_key}"
        if self.opts.session_header and session.session_id:
            h["x-session-id"] = session.session_id
        return h

    async def send(
        self, session: Session, turn_index: int, history: History, t0: float
    ) -> RequestRecord:
        """POST one turn, read its stream to the end, return its timings (never raises
        for HTTP or stream failures: they become `record.error`)."""
        turn = session.turns[turn_index]
        start = time.perf_counter()
        rec = RequestRecord(
            session.index, turn_index, start - t0, _history_tokens(session, history, turn), turn.output_len,
            request_id=self.request_id(session, turn_index),
        )
        try:
            body = self.body(session, history, turn)
            if self.shape.delta is None:
                await self._pooled(body, rec, start, self.headers(session, turn_index))
                return rec
            async with self.http.stream("POST", self.url, json=body, headers=self.headers(session, turn_index)) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    rec.error = f"http_{resp.status_code}"
                    return rec
                await self._read_stream(resp, rec, start, t0)
        except httpx.HTTPError as exc:
            rec.error = type(exc).__name__
        except (AttributeError, KeyError, TypeError, ValueError):  # a chunk of the wrong shape
            rec.error = "bad_stream"
        return rec

    async def _pooled(self, body: dict[str, Any], rec: RequestRecord, start: float,
                      headers: dict[str, str]) -> None:
        """One non-streamed request (embeddings, classification): its latency is both
        its TTFT and its E2E; usage's prompt tokens, no output."""
        resp = await self.http.post(self.url, json=body, headers=headers)
        rec.e2e = rec.ttft = time.perf_counter() - start
        if resp.status_code != 200:
            rec.error = f"http_{resp.status_code}"
            return
        answer = resp.json()
        if not answer.get("data"):
            rec.error = "no_output"
            return
        rec.prompt_tokens = int((answer.get("usage") or {}).get("prompt_tokens") or 0) \
            or rec.expected_prompt_tokens

    async def _read_stream(
        self, resp: httpx.Response, rec: RequestRecord, start: float, t0: float
    ) -> None:
        delta = self.shape.delta
        assert delta is not None, "a streamed endpoint"
        last: float | None = None
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            try:
                chunk = json.loads(data)
            except ValueError:
                rec.error = "bad_stream"
                return
            if "error" in chunk and not chunk.get("choices"):
                rec.error = "stream_error"
                return
            text = delta(chunk)
            if text:
                if last is None:
                    rec.ttft = now - start
                else:
                    rec.itls.append(now - last)
                last = now
                rec.token_times.append(now - t0)
                rec.text += text
            usage = chunk.get("usage")
            if usage:
                rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.e2e = time.perf_counter() - start
        if rec.ttft is None:
            rec.error = "no_output"
        elif rec.output_tokens == 0:  # a server without usage in the stream
            rec.output_tokens = len(rec.token_times)
        rec.prompt_tokens = rec.prompt_tokens or rec.expected_prompt_tokens


def _history_tokens(session: Session, history: History, turn: Turn) -> int:
    """The prompt tokens we planned (answers not counted: the server's usage has them)."""
    system = session.system.num_tokens if session.system else 0
    return system + sum(u.num_tokens for u, _ in history) + turn.user.num_tokens
