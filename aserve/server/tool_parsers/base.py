"""The machinery every tool-call parser shares: content holding, call reading, deltas, `extract`.

A parser is a streaming state machine over the generated text. Subclasses implement `_step(text,
i)` (consume from position `i` in the current mode and return the next position) and `_at_finish()`;
this base class gives them:

- content emission with whitespace rules, so that the text around calls does not turn into stray
  content: trailing whitespace is held until non-whitespace follows, leading whitespace right after
  a call section is dropped, and the whitespace just before a section is kept only as the separator
  between the content before and the content after it (dropped when nothing follows). So
  "A\n<call/>\nB" gives "A\nB", "A <call/>" gives "A", and text with no calls at all comes out
  exactly as it went in;
- holding of text that may be the start of a marker (`_hold`), prepended to the next delta;
- `_read_call(text, i)`: feeds a `CallReader` and turns its progress into deltas: one header per
  call (index, id, name, arguments "") as soon as the name is known and the arguments have started,
  then argument fragments only;
- the two failure paths. A call that fails before its header was due ("early": not JSON, no name,
  arguments not an object, or the output ends first) is given back as content, raw, from where its
  section started, and parsing resumes at the offending character. A call that fails after its
  header was due ("late": invalid JSON from the arguments on, or the output ends before the call
  object closes) cannot be taken back from a stream: the streamed call stands as sent, the rest of the output is content,
  and `failed` is True.

`extract(text)` runs the same machine over the whole text, so streaming (split anywhere) and
non-streaming agree, except after a late failure, where `extract` returns the whole text as content
and no calls (a broken call is not a call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from aserve.server.tool_parsers.call_reader import COMPLETE, ERROR, NEED_MORE, CallReader
from aserve.server.tool_parsers.types import (
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    openai_tool_call_id,
)


def partial_suffix_len(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolParser:
    """Base class; one instance parses one choice's output (streaming `feed`/`finish`, or `extract`)."""

    name: ClassVar[str] = ""
    args_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self, new_id: Callable[[], str] = openai_tool_call_id) -> None:
        self._new_id = new_id
        self._out: list[StreamDelta] = []
        self._held = ""  # text held back to the next feed (prepended to it)
        self._trailing_ws = ""  # content whitespace held until non-whitespace follows
        self._strip_leading = False  # drop leading whitespace (right after a call section)
        self._separator = ""  # whitespace from before a call section, emitted with the next content
        self._section_ws = ""  # whitespace just before the current section
        self._has_content = False
        self._section_raw: list[str] = []  # raw text since the current section started
        self._reader: CallReader | None = None
        self._header_sent = False
        self._num_calls = 0
        self._plain = False  # everything from here on is content, verbatim
        self._finished = False
        self.failed = False

    # -- public interface -----------------------------------------------------------------------

    @property
    def num_calls(self) -> int:
        """The number of calls whose header has been produced so far."""
        return self._num_calls

    def feed(self, delta: str) -> list[StreamDelta]:
        """Consume the next piece of generated text; returns the deltas it completes, in order."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        text, self._held = self._held + delta, ""
        i = 0
        while i < len(text):
            if self._plain:
                self._content(text[i:])
                break
            i = self._step(text, i)
        return self._take()

    def finish(self) -> list[StreamDelta]:
        """The output is complete: flush what was held back and close an open call."""
        if not self._finished:
            self._finished = True
            if self._reader is not None:
                self._end_call_at_finish()
            else:
                self._at_finish()
            self._held = ""
            if self._trailing_ws:
                self._emit_content(self._trailing_ws)
                self._trailing_ws = ""
        return self._take()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """Parse a complete output: (content or None, calls). A late failure gives (text, []).

        Call it on a fresh parser (it feeds and finishes this one).
        """
        deltas = self.feed(text) + self.finish()
        if self.failed:
            return (text or None), []
        content = "".join(d.content for d in deltas if d.content is not None)
        heads: dict[int, ToolCallDelta] = {}
        args: dict[int, list[str]] = {}
        for d in deltas:
            for tc in d.tool_calls:
                if tc.is_header:
                    heads[tc.index] = tc
                args.setdefault(tc.index, []).append(tc.arguments)
        calls = [
            ToolCall(id=h.id or "", name=h.name or "", arguments="".join(args[i])) for i, h in heads.items()
        ]
        return (content or None), calls

    # -- for subclasses -------------------------------------------------------------------------

    def _step(self, text: str, i: int) -> int:
        raise NotImplementedError

    def _at_finish(self) -> None:
        """Called by `finish` when no call is open: flush or drop the subclass's held text."""

    def _after_call(self) -> None:
        """Called when a call object completes; sets the mode that follows it."""
        raise NotImplementedError

    def _after_early_failure(self) -> None:
        """Called after a failed call was given back as content; sets the mode to resume in."""
        raise NotImplementedError

    def _hold(self, text: str) -> int:
        """Keep `text` for the next feed (or `_at_finish`); returns a position that ends the loop."""
        self._held = text
        return 1 << 62

    def _content(self, text: str) -> None:
        """Emit model text as content, applying the whitespace rules."""
        if self._strip_leading:
            stripped = text.lstrip()
            if not stripped:
                return
            self._strip_leading = False
            text = stripped
        body = text.rstrip()
        if body:
            self._emit_content(self._separator + self._trailing_ws + body)
            self._separator = ""
            self._trailing_ws = text[len(body) :]
        else:
            self._trailing_ws += text

    def _start_section(self, raw_prefix: str) -> None:
        """A call section starts: held whitespace goes to the section's raw text, not to content."""
        self._section_raw = [self._trailing_ws, raw_prefix]
        self._section_ws = self._trailing_ws
        self._trailing_ws = ""

    def _give_back_section(self) -> None:
        """Emit the current section's raw text as content (an early failure)."""
        raw = "".join(self._section_raw)
        self._section_raw = []
        self._section_ws = ""
        self._strip_leading = False
        self._content(raw)

    def _scan_for_marker(self, text: str, i: int, marker: str) -> tuple[int, bool]:
        """Content mode: emit `text[i:]` up to `marker`; returns (next position, marker found).

        When the marker is found, a section starts just after it. Otherwise a tail that may be the
        start of the marker is held back for the next feed.
        """
        rest = text[i:]
        idx = rest.find(marker)
        if idx >= 0:
            self._content(rest[:idx])
            self._start_section(marker)
            return i + idx + len(marker), True
        k = partial_suffix_len(rest, marker)
        self._content(rest[: len(rest) - k])
        if k:
            return self._hold(rest[len(rest) - k :]), False
        return len(text), False

    def _read_call(self, text: str, i: int) -> int:
        """Feed the open call from `text[i]`; returns where to continue."""
        if self._reader is None:
            self._reader = CallReader(self.args_keys)
            self._header_sent = False
        reader = self._reader
        raw = self._section_raw
        n = len(text)
        start = i
        status = NEED_MORE
        while i < n:
            status = reader.feed(text[i])
            if status == ERROR:
                break
            i += 1
            if status == COMPLETE:
                break
        raw.append(text[start:i])
        self._sync_call()
        if status == COMPLETE:
            self._reader = None
            self._section_raw = []
            if self._section_ws and self._has_content:
                self._separator = self._section_ws
            self._section_ws = ""
            self._after_call()
        elif status == ERROR:
            self._reader = None
            if self._header_sent:
                self._fail_late()
            else:
                self._give_back_section()
                self._after_early_failure()
        return i

    # -- internals ------------------------------------------------------------------------------

    def _sync_call(self) -> None:
        reader = self._reader
        assert reader is not None
        if not self._header_sent and reader.header_ready:
            self._header_sent = True
            header = ToolCallDelta(index=self._num_calls, id=self._new_id(), name=reader.name)
            self._num_calls += 1
            self._out.append(StreamDelta(tool_calls=(header,)))
        if self._header_sent:
            fragment = reader.take_args()
            if fragment:
                self._out.append(
                    StreamDelta(tool_calls=(ToolCallDelta(index=self._num_calls - 1, arguments=fragment),))
                )

    def _fail_late(self) -> None:
        self.failed = True
        self._plain = True
        self._strip_leading = False
        self._section_raw = []

    def _end_call_at_finish(self) -> None:
        self._sync_call()
        self._reader = None
        if self._header_sent:
            self._fail_late()
        else:
            self._give_back_section()

    def _emit_content(self, text: str) -> None:
        self._has_content = True
        if self._out and self._out[-1].content is not None:
            self._out[-1] = StreamDelta(content=self._out[-1].content + text)
        else:
            self._out.append(StreamDelta(content=text))

    def _take(self) -> list[StreamDelta]:
        out, self._out = self._out, []
        return out
