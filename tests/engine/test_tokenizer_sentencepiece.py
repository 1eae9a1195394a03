"""GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`: Llama 2,
Mistral, Gemma): the tokenizer rebuilt from the file encodes and decodes as SentencePiece
itself does. The vocabularies are trained here (sentencepiece's BPE trainer, byte
fallback, no normalization: how Llama's and Gemma's tokenizers are set), written into a
GGUF as llama.cpp's converter writes them (pieces, scores, token types, special ids,
`add_space_prefix`), and a Gemma 3 file that carries one is served with it."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import sentencepiece as spm  # a dev dependency
import torch

from sluice.engine.tokenizer import Tokenizer, gguf_tokenizer
from sluice.protocol.errors import InvalidRequestError

CORPUS = [
    "The quick brown fox jumps over the lazy dog, and then it rests in the sun.",
    "A tokenizer splits text into pieces; each piece has an id and a score.",
    "Numbers like 12, 345 and 6789 appear, and so do tabs\tand new lines.",
    "Serving models on a laptop: prefill, decode, the cache, the scheduler.",
    "She sells sea shells by the sea shore; the shells she sells are sea shells.",
] * 40
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, and  two inside  ",
    "lines\nand\ttabs\n\n",
    "unseen words: zygote, quixotic, 42x",
    "日本語のテキスト 🌍 café",  # no piece: byte fallback
    "",
    " ",
    "the sea shells",
]


def train(tmp_path: Path, dummy_prefix: bool) -> spm.SentencePieceProcessor:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, model_type="bpe",
        vocab_size=500, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=dummy_prefix, split_digits=True,
        character_coverage=1.0, user_defined_symbols=["<tool>"], minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def write_vocab_gguf(sp: spm.SentencePieceProcessor, path: Path, dummy_prefix: bool) -> Path:
    """A GGUF of the vocabulary alone."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    add_vocab(writer, sp, dummy_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_vocab(writer: Any, sp: spm.SentencePieceProcessor, dummy_prefix: bool) -> None:
    """The vocabulary as llama.cpp's converter writes a SentencePiece one."""
    import gguf

    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        kind = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif sp.is_byte(i):
            kind = gguf.TokenType.BYTE
        elif sp.is_unused(i):
            kind = gguf.TokenType.UNUSED
        elif tokens[-1] == "<tool>":
            kind = gguf.TokenType.USER_DEFINED
        types.append(kind)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(dummy_prefix)


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[spm.SentencePieceProcessor, Tokenizer]:
    """Llama 2's and Mistral's setting (a space before the text), and Gemma's (none)."""
    folder = tmp_path_factory.mktemp("spm")
    sp = train(folder, request.param)
    return sp, gguf_tokenizer(write_vocab_gguf(sp, folder / "vocab.gguf", request.param))


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_and_decodes_as_sentencepiece(
        pair: tuple[spm.SentencePieceProcessor, Tokenizer], text: str) -> None:
    sp, tok = pair
    want = sp.encode(text)
    assert tok.encode(text, add_special_tokens=False) == want
    assert tok.encode(text) == [sp.bos_id(), *want]
    assert tok.decode(want) == sp.decode(want)


def test_byte_fallback_pieces_join_into_the_text(
        pair: tuple[spm.SentencePieceProcessor, Tokenizer]) -> None:
    """A character no piece covers is its UTF-8 bytes (`<0xE6>` ...); their bytes join
    into the character, as constrained decoding reads them."""
    sp, tok = pair
    ids = tok.encode("🌍", add_special_tokens=False)
    assert all(tok.convert_ids_to_tokens([i])[0].startswith("<0x") for i in ids[-4:])
    assert b"".join(tok.token_bytes(i) for i in ids).decode().strip() == "🌍"


def test_special_and_user_defined_tokens(
        pair: tuple[spm.SentencePieceProcessor, Tokenizer]) -> None:
    """Control tokens are special (matched in a chat template's text, kept out of
    decoded text), a user-defined piece is one token wherever it appears; the text
    between them is tokenized fragment by fragment, each with the space prefix where
    the file asks for one (llama.cpp's reading: SentencePiece prefixes only the whole
    text, so it differs after a user-defined piece)."""
    sp, tok = pair
    bos, eos = sp.id_to_piece(sp.bos_id()), sp.id_to_piece(sp.eos_id())
    ids = tok.encode(f"{bos}hi there{eos}", add_special_tokens=False)
    assert ids == [sp.bos_id(), *sp.encode("hi there"), sp.eos_id()]
    assert tok.decode(ids).strip() == "hi there"
    for text, parts in (("call <tool> now", ("call ", " now")),
                        ("call<tool>now", ("call", "now"))):
        want = [*sp.encode(parts[0]), sp.piece_to_id("<tool>"), *sp.encode(parts[1])]
        assert tok.encode(text, add_special_tokens=False) == want
    assert tok.bos_token_id == sp.bos_id() and sp.eos_id() in tok.eos_token_ids


def test_scores_must_cover_the_vocabulary(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a"])
    writer.add_token_scores([0.0, 0.0])
    writer.add_token_types([2, 3, 3, 1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(InvalidRequestError) as err:
        gguf_tokenizer(path)
    assert err.value.param == "model" and "2 entries for 4 tokens" in str(err.value)


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_gemma3_gguf_with_its_vocabulary_generates_as_transformers(tmp_path: Path) -> None:
    """A `gemma3` file carrying its SentencePiece vocabulary (no space prefix, as Gemma's)
    and chat template loads with no other tokenizer: prompts tokenize as SentencePiece
    does (BOS first) and greedy tokens equal transformers' `generate` on the checkpoint
    the file was written from; a chat renders through the file's template."""
    from transformers import AutoModelForCausalLM

    from sluice.engine.llm import LLM
    from sluice.engine.sampling_params import SamplingParams
    from tiny_models import make_tiny_checkpoint, write_gguf

    sp = train(tmp_path, dummy_prefix=False)
    hf_dir = make_tiny_checkpoint(tmp_path / "tiny-gemma3", "gemma3", query_pre_attn_scalar=32,
                                  vocab_size=sp.get_piece_size(), bos_token_id=sp.bos_id(),
                                  eos_token_id=sp.eos_id())

    def vocabulary(writer: Any) -> None:
        add_vocab(writer, sp, dummy_prefix=False)
        writer.add_chat_template(GEMMA_TEMPLATE)

    path = write_gguf(hf_dir, tmp_path / "tiny-gemma3.gguf", "f32", arch="gemma3",
                      metadata=vocabulary)
    llm = LLM(str(path), num_kv_blocks=64, dtype="float32")
    texts = ["The quick brown fox jumps over the lazy dog.", "sea shells 12 🌍"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(texts, params)
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for text, out in zip(texts, outputs, strict=True):
        ids = [sp.bos_id(), *sp.encode(text)]
        assert out.prompt_token_ids == ids
        with torch.inference_mode():
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=6,
                               min_new_tokens=6, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == want
    chat = llm.chat([{"role": "user", "content": "hi"}], params)[0]
    assert chat.prompt_token_ids[0] == sp.bos_id() and len(chat.outputs[0].token_ids) == 6
