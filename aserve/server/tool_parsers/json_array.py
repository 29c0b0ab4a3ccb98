"""Calls as a JSON array of objects: `mistral` (`[TOOL_CALLS][{...}, ...]`) and forced calls.

`JsonArrayToolParser` reads an optional marker, then `[` and call objects separated by `,` up to
`]` (a single object without the brackets is accepted too). With a marker, text before it is
content and the marker may come anywhere (again after a section closes); without one (the output
of a `tool_choice="required"` grammar) the array must open the output. Text after the array is
content (leading whitespace dropped). An array that is not a list of calls is content, verbatim;
see `base.py` for calls that break after their header.

`MistralToolParser` is the `mistral` format of Mistral 7B Instruct v0.3 and later pre-v11 models:
the marker `[TOOL_CALLS]` is a special token, so the server must not skip special tokens while
tools are parsed; ids are 9 letters and digits, as Mistral's templates require.
"""

from __future__ import annotations

from aserve.server.tool_parsers.base import ToolParser
from aserve.server.tool_parsers.types import mistral_tool_call_id

MISTRAL_MARKER = "[TOOL_CALLS]"

_CONTENT, _OPEN, _FIRST, _NEXT, _CALL, _AFTER, _AFTER_SINGLE = range(7)


class JsonArrayToolParser(ToolParser):
    """Parses `marker? [call, call, ...]`; `marker=None` means the array opens the output."""

    def __init__(self, *, marker: str | None, args_keys: tuple[str, ...], **kwargs) -> None:
        super().__init__(**kwargs)
        self._marker = marker
        self.args_keys = args_keys
        self._in_array = False
        self._section_calls = 0
        self._mode = _CONTENT if marker is not None else _OPEN
        if marker is None:
            self._start_section("")

    def _step(self, text: str, i: int) -> int:
        mode = self._mode
        if mode == _CONTENT:
            if self._marker is None:
                self._plain = True
                return i
            i, found = self._scan_for_marker(text, i, self._marker)
            if found:
                self._mode, self._section_calls = _OPEN, 0
            return i
        if mode == _CALL:
            return self._read_call(text, i)
        j = i
        n = len(text)
        while j < n and text[j].isspace():
            j += 1
        if mode in (_OPEN, _FIRST, _NEXT):
            self._section_raw.append(text[i:j])
        if j == n:
            return j
        ch = text[j]
        if mode == _OPEN:
            if ch == "[":
                self._section_raw.append(ch)
                self._mode, self._in_array = _FIRST, True
                return j + 1
            if ch == "{":
                self._mode, self._in_array = _CALL, False
                return j
            return self._fail_before_call(j)
        if mode == _FIRST and ch == "]":
            self._section_raw = []  # an empty list of calls: nothing to report
            self._end_section()
            return j + 1
        if mode in (_FIRST, _NEXT):
            if ch == "{":
                self._mode = _CALL
                return j
            return self._fail_before_call(j)
        # _AFTER (inside the array) or _AFTER_SINGLE
        if mode == _AFTER and ch == ",":
            self._start_section(",")
            self._mode = _NEXT
            return j + 1
        self._end_section()
        return j + 1 if (mode == _AFTER and ch == "]") else j

    def _fail_before_call(self, j: int) -> int:
        self._give_back_section()
        self._after_early_failure()
        return j

    def _end_section(self) -> None:
        self._mode = _CONTENT
        self._strip_leading = True

    def _after_call(self) -> None:
        self._section_calls += 1
        self._mode = _AFTER if self._in_array else _AFTER_SINGLE

    def _after_early_failure(self) -> None:
        self._mode = _CONTENT

    def _at_finish(self) -> None:
        if self._mode == _CONTENT and self._held:
            self._content(self._held)
        elif self._mode in (_OPEN, _FIRST, _NEXT) and self._section_calls == 0:
            self._give_back_section()  # a marker or bracket with no call after it is content


class MistralToolParser(JsonArrayToolParser):
    name = "mistral"

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("new_id", mistral_tool_call_id)
        super().__init__(marker=MISTRAL_MARKER, args_keys=("arguments",), **kwargs)
