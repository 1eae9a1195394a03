"""Incremental detokenization and stop strings, correct for streaming.

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character can be
split over tokens, and some tokenizers change a token's text depending on its left
neighbour. vLLM's answer, used here: keep two offsets into the token list and decode a
small window twice each step,

    ids:  ... [prefix_offset ........ read_offset ....... end]
               prefix_text = decode(ids[prefix_offset:read_offset])
               new_text    = decode(ids[prefix_offset:end])
    delta = new_text[len(prefix_text):]  unless new_text ends in U+FFFD (bytes pending)

Stop strings are searched in the text (they may span tokens); the text is cut before the
stop string (or after it, with include_stop_str_in_output). While a request is still
running, a tail of the text that could be the start of a stop string is held back, so a
streamed delta never has to be taken back.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from sluice.engine.sampling_params import SamplingParams

# Context tokens taken from the prompt so the first output token decodes as it would
# mid-text (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
INITIAL_OFFSET = 5


class Decoder(Protocol):
    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Per-sequence text state. `add_token` appends; `output_text` gives what may be shown."""

    def __init__(self, tokenizer: Decoder, prompt_ids: Seq[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids = list(prompt_ids[-INITIAL_OFFSET:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stopped = False
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; return the stop string if it completed one (then the
        text is cut there). `check_stop=False` (before min_tokens) skips the search."""
        self.ids.append(token_id)
        skip = self.params.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        old_len = len(self.text)
        self.text += new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._compact()
        return self._check_stop(old_len) if check_stop else None

    def _compact(self) -> None:
        if self.prefix_offset > 64:  # keep the window list short for long generations
            self.ids = self.ids[self.prefix_offset:]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _check_stop(self, old_len: int) -> str | None:
        if not self.params.stop:
            return None
        start = max(0, old_len - self.max_stop_len + 1)
        found: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, start)
            if idx >= 0 and (found is None or idx < found[0]):
                found = (idx, stop)
        if found is None:
            return None
        idx, stop = found
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:end]
        self.stopped = True
        return stop

    def output_text(self, finished: bool) -> str:
        """The text that may be shown now: all of it when finished, else without a tail
        that could still grow into a stop string."""
        if finished or self.stopped or not self.params.stop:
            return self.text
        return self.text[: len(self.text) - self._held_back()]

    def _held_back(self) -> int:
        hold = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return hold
