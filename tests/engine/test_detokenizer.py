"""Incremental detokenizer with SmolLM2's real tokenizer: multi-byte text, stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.sampling_params import SamplingParams

TEXT = "Grüße from 東京 🌍🚀 — café naïve ½ done."


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def feed(tok: Any, text: str, params: SamplingParams,
         prompt: str = "Say:") -> tuple[IncrementalDetokenizer, list[str], str | None]:
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), params)
    shown, stop = [], None
    for token in tok.encode(text, add_special_tokens=False):
        before = detok.output_text(False)
        stop = detok.add_token(token)
        after = detok.output_text(stop is not None)
        assert after.startswith(before)  # streamed text is never taken back
        shown.append(after[len(before):])
        if stop is not None:
            break
    return detok, shown, stop


def test_streamed_deltas_rebuild_multibyte_text_exactly(tok: Any) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT.split())  # some characters span several tokens
    detok, shown, stop = feed(tok, TEXT, SamplingParams())
    assert stop is None
    assert "".join(shown) == TEXT == detok.text
    assert all("\ufffd" not in delta for delta in shown)


def test_stop_string_spanning_tokens_is_cut(tok: Any) -> None:
    detok, shown, stop = feed(tok, "The answer is 東京 indeed.", SamplingParams(stop=["京 ind"]))
    assert stop == "京 ind"
    assert detok.text == "The answer is 東"
    assert "".join(shown) == "The answer is 東"


def test_include_stop_str_in_output(tok: Any) -> None:
    params = SamplingParams(stop=["is"], include_stop_str_in_output=True)
    detok, _, stop = feed(tok, "This is it", params)
    assert stop == "is" and detok.text == "This"


def test_possible_stop_prefix_is_held_back_until_resolved(tok: Any) -> None:
    params = SamplingParams(stop=["</answer>"])
    detok = IncrementalDetokenizer(tok, tok.encode("Q"), params)
    for token in tok.encode("ok </ans", add_special_tokens=False):
        assert detok.add_token(token) is None
    assert detok.text == "ok </ans"
    assert detok.output_text(False) == "ok "
    for token in tok.encode("wer> more", add_special_tokens=False):
        if detok.add_token(token) is not None:
            break
    assert detok.stopped and detok.output_text(True) == "ok "


def test_held_back_text_is_released_when_it_cannot_be_a_stop(tok: Any) -> None:
    detok, shown, stop = feed(tok, "a </b> c", SamplingParams(stop=["</answer>"]))
    assert stop is None
    assert detok.output_text(False) == "a </b> c"
