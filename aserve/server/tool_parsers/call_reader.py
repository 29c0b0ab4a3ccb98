"""Reads one tool-call JSON object, `{"name": "...", "<args key>": {...}}`, a character at a time.

The reader validates the object as JSON while it arrives (`JsonCursor`), decodes the function name
once its string closes, and keeps the raw text of the arguments object exactly as the model wrote
it, so that the streamed fragments and the non-streaming `arguments` are the same characters.

Rules (anything else is an error):
- the value is an object (leading whitespace allowed);
- `"name"` is a non-empty string, given once;
- the arguments are under one of `args_keys` (e.g. "arguments", "parameters"), given at most once,
  and are an object; a call without arguments gets "{}";
- other keys are ignored.

`header_ready` becomes True, and stays True, as soon as the name is known and either the
arguments object has started or the call object is complete; from then on the call counts as
started (its header may be sent). Keys may come in any order: arguments read before the name are
kept and handed out after it.
"""

from __future__ import annotations

import json

from aserve.server.tool_parsers.json_cursor import (
    KEY_END,
    KEY_START,
    VALUE_END_AT,
    VALUE_END_BEFORE,
    VALUE_START,
    JsonCursor,
)

NEED_MORE = 0
COMPLETE = 1
ERROR = 2


class CallReader:
    """One call object in progress; `feed` returns NEED_MORE, COMPLETE or ERROR (then stop feeding)."""

    __slots__ = (
        "_args",
        "_args_keys",
        "_args_started",
        "_args_taken",
        "_cursor",
        "_key",
        "_value",
        "_value_key",
        "complete",
        "name",
    )

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self._cursor = JsonCursor()
        self._args_keys = args_keys
        self._key: list[str] | None = None  # raw text of the member key being read
        self._value: list[str] | None = None  # raw text of the member value being read
        self._value_key: str | None = None  # the key whose value is being read
        self._args: list[str] = []
        self._args_taken = 0
        self._args_started = False
        self.name: str | None = None
        self.complete = False

    @property
    def header_ready(self) -> bool:
        """The name is known and the arguments have started (or the call is complete)."""
        return self.name is not None and (self._args_started or self.complete)

    def take_args(self) -> str:
        """The arguments text read since the last call (empty until `header_ready`)."""
        if not self.header_ready or self._args_taken == len(self._args):
            return ""
        fragment = "".join(self._args[self._args_taken :])
        self._args_taken = len(self._args)
        return fragment

    def feed(self, ch: str) -> int:
        if not self._cursor.feed(ch):
            return ERROR
        handled = False
        for kind, depth in self._cursor.events:
            if depth == 0:
                if kind == VALUE_START and ch != "{":
                    return ERROR
                if kind == VALUE_END_AT:
                    return self._on_object_end()
                continue
            if depth != 1:
                continue
            if kind == KEY_START:
                self._key, handled = [ch], True
            elif kind == KEY_END:
                assert self._key is not None
                self._key.append(ch)
                self._value_key, self._key, handled = json.loads("".join(self._key)), None, True
            elif kind == VALUE_START:
                self._value, handled = [ch], True
                if not self._on_value_start(ch):
                    return ERROR
            elif kind == VALUE_END_AT:
                if not handled and self._value is not None:
                    self._value.append(ch)
                handled = True
                if not self._on_value_end():
                    return ERROR
            elif kind == VALUE_END_BEFORE and not self._on_value_end():
                return ERROR
        if not handled:
            if self._key is not None:
                self._key.append(ch)
            elif self._value is not None:
                self._value.append(ch)
        return NEED_MORE

    def _on_value_start(self, ch: str) -> bool:
        key = self._value_key
        if key == "name":
            return self.name is None and ch == '"'
        if key in self._args_keys:
            if self._args_started or ch != "{":
                return False
            self._args_started = True
            self._args = self._value  # the same list: argument characters are visible as they arrive
        return True

    def _on_value_end(self) -> bool:
        if self._value_key == "name":
            assert self._value is not None
            name = json.loads("".join(self._value))
            if not name:
                return False
            self.name = name
        self._value, self._value_key = None, None
        return True

    def _on_object_end(self) -> int:
        if self.name is None:
            return ERROR
        if not self._args_started:
            self._args = ["{}"]
        self.complete = True
        return COMPLETE
