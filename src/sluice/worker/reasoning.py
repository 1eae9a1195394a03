"""Reasoning parsers (vLLM's `--reasoning-parser`): a reasoning model writes its thinking
between `<think>` and `</think>`, then its answer. The chat route hands the thinking out
as the message's `reasoning` (and `reasoning_content`, vLLM's earlier name, which
DeepSeek's API and LiteLLM read) and only the answer as `content`, where the tool-call
parser looks for calls.

    deepseek_r1   the chat template opens the thinking in the prompt (DeepSeek-R1, QwQ,
                  Qwen3 "Thinking" models): everything before `</think>` is reasoning
                  (a leading `<think>` dropped); no `</think>`, all of it
    qwen3         the model opens it itself (Qwen3's hybrid models): reasoning only when
                  the output starts with `<think>`, up to `</think>` (or the end)

Whitespace before a leading `<think>` is dropped; what follows `</think>` is the answer
as written. A stream gives the same split: text that may be the start of a tag is held
back until the next delta (or the end) tells.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.engine.config import REASONING_PARSERS as ENGINE_PARSERS

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_in_prompt: bool  # deepseek_r1: the output begins inside the thinking

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output as (reasoning, content); None for an empty part."""
        stream = self.stream()
        reasoning, content = stream.feed(text, finished=True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.opened_in_prompt)


@dataclass
class ReasoningStream:
    """One choice's output, delta by delta: `feed` answers (reasoning, content) text."""

    opened_in_prompt: bool
    # "start" before the first text, then "think" or "answer"
    state: str = field(default="start", init=False)
    held: str = ""  # text that may be the start of a tag

    @property
    def thinking(self) -> bool:
        """Inside the thinking block (a held piece of a tag included)."""
        return self.state == "think"

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text, self.state = stripped[len(START):], "think"
                elif START.startswith(stripped) and not finished:
                    self.held = text  # "<thi" (or only whitespace so far): wait
                    break
                else:
                    self.state = "think" if self.opened_in_prompt else "answer"
            elif self.state == "think":
                at = text.find(END)
                if at >= 0:
                    reasoning.append(text[:at])
                    text, self.state = text[at + len(END):], "answer"
                    continue
                keep = 0 if finished else _partial_tag(text, END)
                reasoning.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            else:
                content.append(text)
                break
        if finished and self.held:  # (only a whitespace start or a partial tag)
            (reasoning if self.state == "think" else content).append(self.held)
            self.held = ""
        return "".join(reasoning), "".join(content)


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` begin `tag` (to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# one table with the engine's, which starts a constrained output's grammar after the
# thinking (engine.structured_output.Thinking)
REASONING_PARSERS = {name: ReasoningParser(name, opened_in_prompt=opened)
                     for name, opened in ENGINE_PARSERS.items() if name}
