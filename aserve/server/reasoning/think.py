"""Reasoning parsers for `<think>...</think>` models: split the output into reasoning and content.

One `ThinkParser` instance reads one choice's output, either whole (`extract`) or as a stream
(`feed` / `finish`); both follow the same rules, so a stream split anywhere concatenates to exactly
what `extract` returns (with "" and None equivalent):

1. The output may open with the start tag (after optional whitespace); it is dropped, and the
   parser is then inside the think block.
2. Without that opening tag, the parser is inside the block only if it `starts_in_reasoning`:
   the default for `deepseek_r1` (its template ends the prompt inside the block, so the model
   writes no `<think>`) and never for `qwen3` (whose output with no `<think>` is plain content).
   A prompt can override the default: see `ThinkParser.for_prompt`.
3. Inside the block, text up to the first end tag is reasoning; the end tag is dropped, and the
   text after it (leading whitespace dropped) is content. Any later tag is plain content.
4. An unterminated block (the output ended first) is all reasoning and no content.

While streaming, text that may be the start of a tag is held back until it is known not to be one
(`finish` flushes it under the rules above). `reasoning_ended` tells whether content has started;
`content_offset(text)` finds where, for the grammar layer that constrains only the content.
"""

from __future__ import annotations

from typing import ClassVar


def _partial_suffix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


_OPENING, _REASONING, _CONTENT_START, _CONTENT = range(4)


class ThinkParser:
    """Base class; subclasses set `name` and `starts_in_reasoning_default`."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    starts_in_reasoning_default: ClassVar[bool] = False

    def __init__(self, *, starts_in_reasoning: bool | None = None, reasoning_closed: bool = False) -> None:
        """`reasoning_closed`: the prompt already closed the block, so the whole output is content."""
        self._starts_in_reasoning = (
            self.starts_in_reasoning_default if starts_in_reasoning is None else starts_in_reasoning
        )
        self._reasoning_closed = reasoning_closed
        self._state = _CONTENT if reasoning_closed else _OPENING
        self._held = ""
        self._finished = False

    @classmethod
    def for_prompt(cls, prompt: str | None) -> ThinkParser:
        """A parser for an output that continues `prompt` (the rendered chat prompt, if known).

        A prompt ending with the start tag (after trailing whitespace) starts inside the block; one
        ending with the end tag (e.g. Qwen3 with `enable_thinking=False`) makes the whole output
        content; any other prompt keeps the parser's default.
        """
        tail = (prompt or "").rstrip()
        if tail.endswith(cls.start_tag):
            return cls(starts_in_reasoning=True)
        if tail.endswith(cls.end_tag):
            return cls(reasoning_closed=True)
        return cls()

    @property
    def reasoning_ended(self) -> bool:
        """Content has started: the end tag was read (or the output was never reasoning)."""
        return self._state in (_CONTENT_START, _CONTENT)

    def feed(self, delta: str) -> tuple[str | None, str | None]:
        """The next piece of output -> (reasoning delta, content delta); None where there is none."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        text, self._held = self._held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        i = 0
        while i < len(text):
            i = self._step(text, i, reasoning, content)
        return "".join(reasoning) or None, "".join(content) or None

    def finish(self) -> tuple[str | None, str | None]:
        """The output is complete: what was held back, under the rules in the module docstring."""
        if self._finished:
            return None, None
        self._finished = True
        held, self._held = self._held, ""
        if not held:
            return None, None
        if self._state == _OPENING:  # whitespace or a partial start tag, and nothing after it
            return (held, None) if self._starts_in_reasoning else (None, held)
        return held, None  # _REASONING holds a partial end tag: the block is unterminated

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """A complete output -> (reasoning or None, content or None)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 or "") + (r2 or "") or None, (c1 or "") + (c2 or "") or None

    def content_offset(self, text: str) -> int | None:
        """Where content may start in `text` (this parser's output so far), or None while reasoning.

        The offset is just after the end tag (whitespace after it is not skipped), 0 when the
        output is not reasoning at all, and None while the block is open or the opening tag may
        still come. It is a pure function of `text` and this parser's starting rules.
        """
        if self._reasoning_closed:
            return 0
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            end = text.find(self.end_tag, len(text) - len(stripped) + len(self.start_tag))
        elif self.start_tag.startswith(stripped):
            return None  # the opening tag may still come
        elif self._starts_in_reasoning:
            end = text.find(self.end_tag)
        else:
            return 0
        return None if end < 0 else end + len(self.end_tag)

    # -- internals ------------------------------------------------------------------------------

    def _step(self, text: str, i: int, reasoning: list[str], content: list[str]) -> int:
        state = self._state
        if state == _CONTENT:
            content.append(text[i:])
            return len(text)
        if state == _CONTENT_START:
            rest = text[i:]
            stripped = rest.lstrip()
            if stripped:
                self._state = _CONTENT
            return len(text) - len(stripped)
        if state == _OPENING:
            rest = text[i:]
            stripped = rest.lstrip()
            if not stripped or (self.start_tag.startswith(stripped) and stripped != self.start_tag):
                self._held = rest
                return len(text)
            if stripped.startswith(self.start_tag):
                self._state = _REASONING
                return len(text) - len(stripped) + len(self.start_tag)
            self._state = _REASONING if self._starts_in_reasoning else _CONTENT
            return i
        # _REASONING
        rest = text[i:]
        end = rest.find(self.end_tag)
        if end >= 0:
            reasoning.append(rest[:end])
            self._state = _CONTENT_START
            return i + end + len(self.end_tag)
        k = _partial_suffix_len(rest, self.end_tag)
        reasoning.append(rest[: len(rest) - k])
        if k:
            self._held = rest[len(rest) - k :]
        return len(text)
