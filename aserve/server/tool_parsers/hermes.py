"""`hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

Used by Hermes 2 Pro / 3, Qwen2.5 and the bundled chat templates' tool prompt (`prompt.py`). Any
number of blocks may appear, with text before, between and after them (that text is content; see
`base.py` for the whitespace rules). Within a block the object may be surrounded by whitespace; the
closing `</tool_call>` may be missing (the output ended, or the next block starts), and text after
the object that is not `</tool_call>` ends the block and is content. A block whose JSON is not a
call is content, verbatim (see `base.py` for calls that break after their header).
"""

from __future__ import annotations

from aserve.server.tool_parsers.base import ToolParser

START = "<tool_call>"
END = "</tool_call>"

_CONTENT, _CALL, _AFTER = range(3)


class HermesToolParser(ToolParser):
    name = "hermes"
    args_keys = ("arguments",)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._mode = _CONTENT

    def _step(self, text: str, i: int) -> int:
        if self._mode == _CONTENT:
            i, found = self._scan_for_marker(text, i, START)
            if found:
                self._mode = _CALL
            return i
        if self._mode == _CALL:
            return self._read_call(text, i)
        # _AFTER: whitespace, then the closing tag (optional)
        rest = text[i:]
        stripped = rest.lstrip()
        i += len(rest) - len(stripped)
        if not stripped:
            return len(text)
        if stripped.startswith(END):
            self._enter_content()
            return i + len(END)
        if END.startswith(stripped):
            return self._hold(stripped)
        self._enter_content()
        return i

    def _enter_content(self) -> None:
        self._mode = _CONTENT
        self._strip_leading = True

    def _after_call(self) -> None:
        self._mode = _AFTER

    def _after_early_failure(self) -> None:
        self._mode = _CONTENT

    def _at_finish(self) -> None:
        if self._mode == _CONTENT and self._held:
            self._content(self._held)
        # in _AFTER, a partial closing tag at the very end is dropped
