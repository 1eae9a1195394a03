"""Real token counts for the benchmark, without torch and without character guesses.

A benchmark must know exactly how many tokens it sends. Two sources, both exact:

- a local `tokenizers` file (`--tokenizer path/to/tokenizer.json`, or a directory
  holding one), or a GGUF file (`--tokenizer model.gguf`, read by
  `sluice.engine.tokenizer`, which does not import torch either), or
- the server's `POST /tokenize` (vLLM's shape: `{"model", "prompt"}` →
  `{"tokens": [...], "count": N}`).

Prompts are built from a *word vocabulary*: common English words that the tokenizer
maps, with a leading space, to exactly one token each. For byte-level BPE tokenizers
(GPT-2, Llama-3, SmolLM2, Qwen2) the pre-tokenizer splits `" w1 w2 w3"` into
`" w1"`, `" w2"`, `" w3"` and encodes each piece on its own, so a text made of these
words encodes back to exactly the same ids: prompts can be sent as token ids to
`/v1/completions` (exact) and as the same text to `/v1/chat/completions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from sluice.protocol.errors import InvalidRequestError

WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is that for it as was with be by on not he this are or his from at
    which but have an they you were her she there one all we their has been if more when
    will would who so no out up into do any your what time can only other new some could
    these two may first then than like its over also after did many most where made such
    through back years much before must good well long way even own just those people
    state world life both under last never day same another while know might great old
    year off come since against go came right used take three small large place found
    house again part point number water home little work hand high still men found public
    down every around form between school end should head often second order given city
    change each case without thought light early night hard family side week car line
    name money book white fact young today river power church party body face mother
    letter music paper market field blue green red black story table game land road
    sound river morning south north west east summer winter spring window garden heart
    street voice horse bird tree stone glass cold warm river short open true free full
    clear close early late strong simple plain sure ready happy quick dark deep wide
    friend father child woman man girl boy king queen doctor teacher student farmer
    bread milk apple fish meat rice salt sugar tea coffee wine beer cake egg
    chair door floor wall roof bed desk lamp clock phone radio film movie picture
    train ship boat plane bus truck bike engine wheel metal wood iron gold silver
    copper plant flower grass leaf forest hill mountain island ocean lake sea beach
    rain snow wind storm cloud sun moon star sky fire earth air energy force speed
    north army war peace law court judge police crime prison vote leader member
    business company office price value cost bank trade sale job pay tax bill
    science theory study test result method data report paper model system program
    computer network server code file page link text word letter sign image color
    animal dog cat cow pig sheep mouse rabbit lion tiger bear wolf fox snake
    health pain blood bone skin hair eye ear nose mouth tooth arm leg foot finger
    reason idea plan goal problem answer question choice chance risk effect cause
    history future past present moment period season century minute hour second
    language art culture nature space travel journey trip visit return arrive leave
    begin start finish stop wait move turn walk run jump swim fly drive ride climb
    build break cut burn fill pull push carry hold catch throw drop lift raise
    speak talk tell ask answer call write read learn teach show watch hear listen
    buy sell give send bring keep lose win find choose decide agree allow offer
    """.split()
)


class TextEncoder(Protocol):
    """What the benchmark needs from a tokenizer: text → ids, without special tokens."""

    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...


class LocalTokenizer:
    """A Hugging Face `tokenizers` file on disk (no transformers, no torch)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise InvalidRequestError(f"no tokenizer file at {file}", param="tokenizer")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for any bad file
            raise InvalidRequestError(f"{file} is not a tokenizers file ({exc})",
                                      param="tokenizer") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encs]


class GGUFTokenizer:
    """The tokenizer inside a GGUF file, through `sluice.engine.tokenizer` (no torch)."""

    def __init__(self, path: str | Path) -> None:
        from sluice.engine.tokenizer import load_tokenizer

        self._tok = load_tokenizer(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


def open_tokenizer(path: str | Path) -> TextEncoder:
    """`--tokenizer PATH`: a .gguf file, a tokenizer.json, or a directory with one."""
    if str(path).endswith(".gguf"):
        if not Path(path).is_file():
            raise InvalidRequestError(f"no GGUF file at {path}", param="tokenizer")
        return GGUFTokenizer(path)
    return LocalTokenizer(path)


class ServerTokenizer:
    """The server's `POST /tokenize` (vLLM's API), called before the run starts.

    Asks for `add_special_tokens: false`; a server that rejects that field is asked
    again without it and the ids it adds to an empty prompt (a BOS) are stripped.
    """

    def __init__(self, client: httpx.Client, base_url: str, model: str) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self._plain: bool | None = None  # True once the server took add_special_tokens
        self._overhead: list[int] = []

    def _post(self, payload: dict[str, object]) -> httpx.Response:
        try:
            return self._client.post(self._url, json=payload)
        except httpx.HTTPError as exc:
            raise InvalidRequestError(
                f"cannot reach {self._url} ({type(exc).__name__}); pass --tokenizer",
                param="tokenizer",
            ) from exc

    def _raw(self, text: str, plain: bool) -> list[int]:
        payload: dict[str, object] = {"model": self._model, "prompt": text}
        if plain:
            payload["add_special_tokens"] = False
        resp = self._post(payload)
        if resp.status_code != 200:
            raise InvalidRequestError(
                f"{self._url} answered {resp.status_code}: {resp.text[:200]}; pass --tokenizer",
                param="tokenizer",
            )
        return [int(t) for t in resp.json()["tokens"]]

    def _negotiate(self) -> None:
        try:
            self._raw("", plain=True)
            self._plain = True
        except InvalidRequestError:
            self._plain = False
            self._overhead = self._raw("", plain=False)

    def encode(self, text: str) -> list[int]:
        if self._plain is None:
            self._negotiate()
        ids = self._raw(text, plain=bool(self._plain))
        n = len(self._overhead)
        return ids[n:] if n and ids[:n] == self._overhead else ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


@dataclass(frozen=True)
class Vocab:
    """Words that are one token each; a prompt is a list of indices into it."""

    words: tuple[str, ...]
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.words) != len(self.ids) or len(self.words) < 2:
            raise InvalidRequestError(
                "the tokenizer maps fewer than 2 test words to single tokens", param="tokenizer"
            )

    def __len__(self) -> int:
        return len(self.words)

    def token_ids(self, indices: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.ids[i] for i in indices)

    def text(self, indices: Sequence[int]) -> str:
        """`" w1 w2 ..."`: encodes back to exactly `token_ids(indices)`."""
        return "".join(" " + self.words[i] for i in indices)


def discover_vocab(encoder: TextEncoder, words: Sequence[str] = WORDS) -> Vocab:
    """Keep the words that encode, with a leading space, to one token; one word per id.

    Words are tokenized as a group and split in halves only where a group's count
    differs from its size, so a server tokenizer needs few requests. A word that comes
    back as the tokenizer's unknown-word token (found by encoding a nonsense word) is
    dropped.
    """
    unique = list(dict.fromkeys(words))
    found: dict[int, str] = {}
    unk = encoder.encode(" qzxqvjw")  # an unknown-word token, if the tokenizer has one
    if len(unk) == 1:
        found[unk[0]] = ""
    _split_groups(encoder, unique, found)
    found = {tid: w for tid, w in found.items() if w}
    ordered = sorted(found.items(), key=lambda kv: unique.index(kv[1]))
    return Vocab(words=tuple(w for _, w in ordered), ids=tuple(i for i, _ in ordered))


def _split_groups(encoder: TextEncoder, group: list[str], found: dict[int, str]) -> None:
    ids = encoder.encode("".join(" " + w for w in group))
    if len(ids) == len(group):
        for word, tid in zip(group, ids, strict=True):
            found.setdefault(tid, word)
        return
    if len(group) > 1:
        mid = len(group) // 2
        _split_groups(encoder, group[:mid], found)
        _split_groups(encoder, group[mid:], found)
