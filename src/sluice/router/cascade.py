"""Model aliases and the cascade: a cheap model first, a large one when a rule says so.

    alias NAME -> TARGET        the body's `model` becomes TARGET (a pool's model, an
                                adapter, another alias), then the routed path as usual
    alias NAME, policy cascade  (config.CascadeSpec)
      prompt rules (before any model runs): longer than max_prompt_tokens, a keyword,
        the offline classifier's P(hard) >= classifier_threshold  -> large
      else the small model, asked for logprobs:
        non-streamed: the whole answer's mean token logprob < min_mean_logprob -> large
        streamed: its first `hold_tokens` tokens are held back; their mean logprob
          < min_mean_logprob -> the small stream is closed and the large one sent;
          else the held events and the rest pass on
      logprobs the client did not ask for are cut from what it sees

The response's `model` is the model that served (the workers put it there), and the
`x-sluice-served-model` and `x-sluice-cascade` (small|large and why) headers say the
same, so the gateway's ledger records and prices the served model. /v1/messages
(Anthropic) has no logprobs: there only the prompt rules apply.

The classifier (`Classifier`) is a logistic regression on hashed word unigrams and
bigrams, trained offline (`Classifier.train`, benchmarks/cascade.py) on the labelled
prompts shipped in `router/data/cascade_prompts.jsonl` and stored as JSON
(`router/data/cascade_classifier.json`, the "builtin" one): no dependency, microseconds
a prompt.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sluice.protocol.errors import InvalidRequestError
from sluice.router.config import AliasSpec, CascadeSpec
from sluice.router.parse import CHAT, COMPLETION, ParsedRequest
from sluice.router.proxy import Relay

BUILTIN = Path(__file__).parent / "data" / "cascade_classifier.json"
SERVED_HEADER = b"x-sluice-served-model"
CASCADE_HEADER = b"x-sluice-cascade"
_WORD = re.compile(r"[a-z0-9']+")
_EVENT_END = re.compile(rb"\r?\n\r?\n")

Send = Callable[[bytes], Awaitable[Any]]  # routed._route on a new body: Relay | ErrorReply


# --- the offline classifier -----------------------------------------------------------------


def features(text: str, dim: int) -> dict[int, float]:
    """Hashed word unigrams and bigrams, plus a log-length feature in slot 0."""
    words = _WORD.findall(text.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
    out: dict[int, float] = {0: math.log1p(len(words))}
    for gram in grams:
        h = int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=4).digest(), "big")
        slot = 1 + h % (dim - 1)
        out[slot] = out.get(slot, 0.0) + 1.0
    return out


@dataclass
class Classifier:
    """P(hard | prompt) = sigmoid(bias + w · features(prompt))."""

    weights: list[float]
    bias: float = 0.0

    @property
    def dim(self) -> int:
        return len(self.weights)

    def p_hard(self, text: str) -> float:
        z = self.bias + sum(self.weights[i] * v for i, v in features(text, self.dim).items())
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    @classmethod
    def train(cls, examples: Sequence[tuple[str, int]], dim: int = 2048, epochs: int = 30,
              lr: float = 0.3, l2: float = 1e-4) -> Classifier:
        """Plain SGD on the log loss, examples in the given order (deterministic)."""
        model = cls([0.0] * dim)
        feats = [(features(t, dim), y) for t, y in examples]
        for _ in range(epochs):
            for f, y in feats:
                g = model._p(f) - y
                model.bias -= lr * g
                for i, v in f.items():
                    model.weights[i] -= lr * (g * v + l2 * model.weights[i])
        return model

    def _p(self, f: dict[int, float]) -> float:
        z = self.bias + sum(self.weights[i] * v for i, v in f.items())
        return 1.0 / (1.0 + math.exp(-max(-30.0, min(30.0, z))))

    def to_json(self) -> str:
        return json.dumps({"kind": "hashed-logreg", "dim": self.dim, "bias": round(self.bias, 6),
                           "weights": [round(w, 6) for w in self.weights]})

    @classmethod
    def load(cls, path: str | Path) -> Classifier:
        where = BUILTIN if str(path) == "builtin" else Path(path)
        try:
            data = json.loads(where.read_text())
            return cls([float(w) for w in data["weights"]], float(data["bias"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(f"cannot read the cascade classifier {path}: {exc}",
                                      param="classifier") from exc


def prompt_text(req: ParsedRequest) -> str:
    """What the prompt rules read: the last user message, or the completion prompt."""
    view = req.view
    if view is None:
        return ""
    if view.messages is not None:
        users = [m for m in view.messages if m.get("role") == "user"]
        content = users[-1].get("content", "") if users else ""
        if isinstance(content, list):
            return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    return " ".join(t for t in view.texts if isinstance(t, str))


# --- aliases --------------------------------------------------------------------------------


class Alias:
    """NAME -> TARGET: the request is routed as TARGET's."""

    def __init__(self, spec: AliasSpec) -> None:
        assert spec.target is not None
        self.name, self.target = spec.name, spec.target

    async def serve(self, req: ParsedRequest, send: Send) -> Any:
        return await send(with_model(req.body, self.target))


class Aliases:
    """The router's aliases by name; `get` is one dict lookup on the hot path."""

    def __init__(self, specs: Iterable[AliasSpec]) -> None:
        self.by_name: dict[str, Alias | Cascade] = {}
        for spec in specs:
            self.by_name[spec.name] = Cascade(spec.cascade) if spec.cascade else Alias(spec)

    def get(self, model: str) -> Alias | Cascade | None:
        return self.by_name.get(model) if self.by_name else None

    def names(self) -> list[str]:
        return list(self.by_name)

    def model_of(self, model: str) -> str:
        """The model an alias's requests are served by, through aliases of aliases (they
        form no cycle: config.py); `model` itself when it is no alias. A cascade has two
        models: 400 naming `model` (ask for its small or large one)."""
        found = self.get(model)
        if found is None:
            return model
        if isinstance(found, Cascade):
            raise InvalidRequestError(f"{model!r} is a cascade of {found.spec.small!r} and "
                                      f"{found.spec.large!r}: name one of them", param="model")
        return self.model_of(found.target)


def with_model(body: dict[str, Any], model: str, **extra: Any) -> bytes:
    return json.dumps({**body, "model": model, **extra}).encode()


# --- the cascade ----------------------------------------------------------------------------


class Cascade:
    """One cascade alias. Holds its rules and its classifier; no per-request state."""

    def __init__(self, spec: CascadeSpec) -> None:
        self.spec = spec
        self.classifier = Classifier.load(spec.classifier) if spec.classifier else None
        self.served = {"small": 0, "large": 0}  # what it decided, for tests and benchmarks

    def prompt_rule(self, req: ParsedRequest) -> str | None:
        """Why the prompt alone sends it to the large model, or None."""
        spec = self.spec
        if spec.max_prompt_tokens is not None and req.approx_chars // 4 > spec.max_prompt_tokens:
            return "length"
        text = prompt_text(req).lower()
        if any(k in text for k in spec.keywords):
            return "keyword"
        if self.classifier is not None and \
                self.classifier.p_hard(text) >= spec.classifier_threshold:
            return "classifier"
        return None

    async def serve(self, req: ParsedRequest, send: Send) -> Any:
        spec = self.spec
        why = self.prompt_rule(req)
        if why is not None:
            return await self._large(req, send, why)
        if spec.min_mean_logprob is None or req.kind not in (CHAT, COMPLETION):
            return self._mark(await send(with_model(req.body, spec.small)), "small", "rules")
        asked = _asked_logprobs(req)
        body = with_model(req.body, spec.small, **_logprob_fields(req))
        reply = await send(body)
        if not isinstance(reply, Relay) or reply.status != 200:
            return self._mark(reply, "small", "error")
        if req.stream:
            return await self._stream(req, send, reply, asked)
        return await self._whole(req, send, reply, asked)

    async def _large(self, req: ParsedRequest, send: Send, why: str) -> Any:
        return self._mark(await send(with_model(req.body, self.spec.large)), "large", why)

    def _mark(self, reply: Any, which: str, why: str) -> Any:
        self.served[which] += 1
        model = self.spec.small if which == "small" else self.spec.large
        extra = [(SERVED_HEADER, model.encode()), (CASCADE_HEADER, f"{which}; {why}".encode())]
        if isinstance(reply, Relay):
            reply.headers = [*reply.headers, *extra]
            return reply
        return replace(reply, headers=[*reply.headers, *extra])  # a complete (error) reply

    async def _whole(self, req: ParsedRequest, send: Send, relay: Relay, asked: bool) -> Any:
        from sluice.router.routed import ErrorReply  # (routed imports this module's users)

        try:
            raw = relay.first
            while data := await relay.read():
                raw += data
        finally:
            relay.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = {}
        mean = mean_logprob(_choice_logprobs(answer))
        if mean is not None and mean < self._threshold:
            return await self._large(req, send, f"logprob {mean:.3f}")
        if not asked:
            _strip(answer)
        body = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        return self._mark(ErrorReply(200, headers, body), "small",
                          f"logprob {mean:.3f}" if mean is not None else "no logprobs")

    @property
    def _threshold(self) -> float:
        assert self.spec.min_mean_logprob is not None
        return self.spec.min_mean_logprob

    async def _stream(self, req: ParsedRequest, send: Send, relay: Relay, asked: bool) -> Any:
        held: list[bytes] = []
        logprobs: list[float] = []
        buffer = relay.first
        ended = False
        try:
            while len(logprobs) < self.spec.hold_tokens and not ended:
                events, buffer = _cut(buffer)
                for event in events:
                    held.append(event)
                    obj = _event_json(event)
                    ended = ended or obj is None
                    if obj is not None:
                        logprobs += _choice_logprobs(obj)
                if len(logprobs) < self.spec.hold_tokens and not ended:
                    data = await relay.read()
                    if not data:
                        ended = True
                    buffer += data
        except BaseException:
            relay.close()
            raise
        mean = mean_logprob(logprobs)
        if mean is not None and mean < self._threshold:
            relay.close()
            return await self._large(req, send, f"logprob {mean:.3f}")
        why = f"logprob {mean:.3f}" if mean is not None else "no logprobs"
        return self._mark(HeldRelay(relay, held, buffer, strip=not asked), "small", why)


class HeldRelay(Relay):
    """The small model's stream after its first tokens were judged: the held events, then
    the rest, whole SSE events only, `logprobs` cut when the client did not ask."""

    __slots__ = ("inner", "pending", "buffer", "strip")

    def __init__(self, inner: Relay, held: list[bytes], buffer: bytes, strip: bool) -> None:
        for name in Relay.__slots__:
            setattr(self, name, getattr(inner, name))
        self.inner, self.strip = inner, strip
        self.headers = [(n, v) for n, v in inner.headers if n != b"content-length"]
        self.length = None
        self.first = b"".join(_clean(e, strip) for e in held)
        self.buffer = buffer

    @property
    def complete(self) -> bool:
        return False  # the front ends read to b""

    async def read(self) -> bytes:
        while True:
            events, self.buffer = _cut(self.buffer)
            if events:
                return b"".join(_clean(e, self.strip) for e in events)
            data = await self.inner.read()
            if not data:
                rest, self.buffer = self.buffer, b""
                return rest
            self.buffer += data

    def close(self) -> None:
        self.inner.close()


# --- logprobs and SSE helpers -----------------------------------------------------------------


def mean_logprob(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _asked_logprobs(req: ParsedRequest) -> bool:
    value = req.body.get("logprobs")
    return value is not None and value is not False


def _logprob_fields(req: ParsedRequest) -> dict[str, Any]:
    """What to add to the small model's body so that it returns token logprobs."""
    if _asked_logprobs(req):
        return {}
    return {"logprobs": True} if req.kind == CHAT else {"logprobs": 0}


def _choice_logprobs(obj: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of the first choice (chat or completion shape)."""
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return []
    lp = choices[0].get("logprobs")
    if not isinstance(lp, dict):
        return []
    if isinstance(lp.get("content"), list):
        return [float(t["logprob"]) for t in lp["content"] if isinstance(t, dict)]
    return [float(x) for x in lp.get("token_logprobs") or [] if x is not None]


def _strip(obj: dict[str, Any]) -> None:
    for choice in obj.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("logprobs", None)


def _cut(buffer: bytes) -> tuple[list[bytes], bytes]:
    events = []
    while (match := _EVENT_END.search(buffer)) is not None:
        events.append(buffer[: match.end()])
        buffer = buffer[match.end():]
    return events, buffer


def _event_json(event: bytes) -> dict[str, Any] | None:
    """The event's `data:` JSON; None for `[DONE]`; {} for anything else."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    if data == b"[DONE]":
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _clean(event: bytes, strip: bool) -> bytes:
    if not strip or b'"logprobs"' not in event:
        return event
    obj = _event_json(event)
    if not obj:
        return event
    _strip(obj)
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
