"""`llama3_json`: Llama 3.1+ JSON tool calls, `{"name": ..., "parameters": {...}}`.

The calls must open the output: optionally `<|python_tag|>` (kept only when special tokens are
not skipped), optional whitespace, then one or more objects separated by `;` (whitespace allowed
around it; a missing `;` between two objects is tolerated). `"arguments"` is accepted in place of
`"parameters"`, as vLLM does. An output that does not start this way is content, verbatim, and is
never searched for calls further on. Text after the last call is content (leading whitespace
dropped); a dangling `;` at the very end is dropped. A first call that is not valid JSON makes the
whole output content; see `base.py` for later calls and for calls that break after their header.
"""

from __future__ import annotations

from aserve.server.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"

_START, _CALL, _BETWEEN = range(3)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    args_keys = ("parameters", "arguments")

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._mode = _START
        self._separator_seen = False  # a ';' was read after the last call

    def _step(self, text: str, i: int) -> int:
        if self._mode == _CALL:
            return self._read_call(text, i)
        rest = text[i:]
        stripped = rest.lstrip()
        if self._mode == _START:
            if not stripped:
                return self._hold(rest)
            lead = rest[: len(rest) - len(stripped)]
            if stripped[0] == "{":
                self._start_section(lead)
                self._mode = _CALL
                return len(text) - len(stripped)
            if stripped.startswith(PYTHON_TAG):  # calls follow; the tag is content only if they fail
                self._start_section(lead + PYTHON_TAG)
                self._mode = _CALL
                return len(text) - len(stripped) + len(PYTHON_TAG)
            if PYTHON_TAG.startswith(stripped):
                return self._hold(rest)
            self._plain = True  # not a tool-call output
            return i
        # _BETWEEN: whitespace and at most one ';' before the next object
        j = i
        while j < len(text):
            ch = text[j]
            if ch == "{":
                self._start_section("")
                self._mode = _CALL
                self._separator_seen = False
                return j
            if ch == ";" and not self._separator_seen:
                self._separator_seen = True
            elif not ch.isspace():
                self._plain = True
                self._strip_leading = True
                return j
            j += 1
        return j

    def _after_call(self) -> None:
        self._mode = _BETWEEN
        self._separator_seen = False

    def _after_early_failure(self) -> None:
        self._plain = True

    def _at_finish(self) -> None:
        if self._mode == _START and self._held:
            self._content(self._held)
        # in _BETWEEN, trailing whitespace and a dangling ';' are dropped
