"""An incremental, validating JSON scanner that reads one character at a time.

`JsonCursor` accepts exactly the JSON grammar (RFC 8259) for a single top-level value and reports,
per character, the structural events a tool-call reader needs: where a value or an object key
starts and ends, at which nesting depth. It never builds Python objects; callers keep the raw text
they care about and decode it with `json.loads` once it is complete.

Contract of `feed(ch)`:
- returns False (and the cursor enters the error state for good) when `ch` cannot continue a valid
  JSON text; every later call also returns False;
- returns True otherwise, leaving the events of this character in `events`: a list of
  `(kind, depth)` pairs in order, where `depth` is the number of containers enclosing the value or
  key (the top-level value has depth 0, an object's members depth 1) and `kind` is one of
  `VALUE_START` (`ch` is the first character of a value), `VALUE_END_AT` (`ch` is the last character
  of a value), `VALUE_END_BEFORE` (a number ended just before `ch`, which is not part of it),
  `KEY_START` / `KEY_END` (`ch` opens / closes an object key string).
- `done` is True once the top-level value is complete; any non-whitespace character after that is
  an error (whitespace is accepted and ignored).
A number at top level can only end with a delimiter, so a bare top-level number is never `done`;
the tool-call formats served here only use objects and arrays at top level.
"""

from __future__ import annotations

VALUE_START = "value_start"
VALUE_END_AT = "value_end_at"
VALUE_END_BEFORE = "value_end_before"
KEY_START = "key_start"
KEY_END = "key_end"

_WS = " \t\n\r"
_DIGITS = "0123456789"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# states
_VALUE = 0  # expecting a value
_OBJ_FIRST = 1  # just after '{': a key or '}'
_OBJ_KEY = 2  # after ',' in an object: a key
_COLON = 3  # after a key: ':'
_ARR_FIRST = 4  # just after '[': a value or ']'
_AFTER = 5  # after a value inside a container: ',' or the closing bracket
_STRING = 6
_ESCAPE = 7
_UNICODE = 8
_NUMBER = 9
_LITERAL = 10
_DONE = 11
_ERROR = 12

# number sub-states; the terminal ones may end the number
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_TERMINAL = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP})


class JsonCursor:
    """Validates one JSON value character by character; see the module docstring for the contract."""

    __slots__ = ("_hex_left", "_is_key", "_literal", "_num", "_stack", "_state", "events")

    def __init__(self) -> None:
        self._stack: list[str] = []  # '{' or '[' per open container
        self._state = _VALUE
        self._is_key = False  # the string being read is an object key
        self._num = _N_MINUS
        self._literal = ""  # the characters a literal still needs
        self._hex_left = 0
        self.events: list[tuple[str, int]] = []

    @property
    def done(self) -> bool:
        """The top-level value is complete."""
        return self._state == _DONE

    @property
    def failed(self) -> bool:
        """An invalid character was fed; the cursor accepts nothing more."""
        return self._state == _ERROR

    @property
    def depth(self) -> int:
        """The number of containers currently open."""
        return len(self._stack)

    def feed(self, ch: str) -> bool:
        """Consume one character; False when it makes the text invalid (see the module docstring)."""
        self.events = []
        ok = self._step(ch)
        if not ok:
            self._state = _ERROR
        return ok

    # -- internals ------------------------------------------------------------------------------

    def _step(self, ch: str) -> bool:
        state = self._state
        if state == _ERROR:
            return False
        if state == _STRING:
            return self._string_char(ch)
        if state == _ESCAPE:
            if ch == "u":
                self._state, self._hex_left = _UNICODE, 4
                return True
            if ch in _ESCAPES:
                self._state = _STRING
                return True
            return False
        if state == _UNICODE:
            if ch not in _HEX:
                return False
            self._hex_left -= 1
            if self._hex_left == 0:
                self._state = _STRING
            return True
        if state == _NUMBER:
            if self._number_char(ch):
                return True
            if self._num not in _N_TERMINAL:
                return False
            self.events.append((VALUE_END_BEFORE, len(self._stack)))
            self._value_done()
            return self._step(ch)  # the delimiter is read in the state after the value
        if state == _LITERAL:
            if ch != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self.events.append((VALUE_END_AT, len(self._stack)))
                self._value_done()
            return True
        if ch in _WS:
            return True
        if state == _VALUE or state == _ARR_FIRST:
            if state == _ARR_FIRST and ch == "]":
                return self._close("[")
            return self._start_value(ch)
        if state == _OBJ_FIRST or state == _OBJ_KEY:
            if ch == '"':
                self.events.append((KEY_START, len(self._stack)))
                self._state, self._is_key = _STRING, True
                return True
            return state == _OBJ_FIRST and ch == "}" and self._close("{")
        if state == _COLON:
            if ch == ":":
                self._state = _VALUE
                return True
            return False
        if state == _AFTER:
            top = self._stack[-1]
            if ch == ",":
                self._state = _OBJ_KEY if top == "{" else _VALUE
                return True
            if ch in "}]":
                return self._close("{" if ch == "}" else "[")
            return False
        return False  # _DONE (non-whitespace after the value) or _ERROR

    def _start_value(self, ch: str) -> bool:
        depth = len(self._stack)
        if ch == "{" or ch == "[":
            self.events.append((VALUE_START, depth))
            self._stack.append(ch)
            self._state = _OBJ_FIRST if ch == "{" else _ARR_FIRST
            return True
        if ch == '"':
            self.events.append((VALUE_START, depth))
            self._state, self._is_key = _STRING, False
            return True
        if ch == "-" or ch in _DIGITS:
            self.events.append((VALUE_START, depth))
            self._state = _NUMBER
            self._num = _N_MINUS if ch == "-" else (_N_ZERO if ch == "0" else _N_INT)
            return True
        literal = _LITERALS.get(ch)
        if literal is not None:
            self.events.append((VALUE_START, depth))
            self._state, self._literal = _LITERAL, literal[1:]
            return True
        return False

    def _string_char(self, ch: str) -> bool:
        if ch == '"':
            depth = len(self._stack)
            if self._is_key:
                self.events.append((KEY_END, depth))
                self._state = _COLON
            else:
                self.events.append((VALUE_END_AT, depth))
                self._value_done()
            return True
        if ch == "\\":
            self._state = _ESCAPE
            return True
        return ch >= " "  # control characters must be escaped

    def _number_char(self, ch: str) -> bool:
        n = self._num
        if ch in _DIGITS:
            if n == _N_MINUS:
                self._num = _N_ZERO if ch == "0" else _N_INT
            elif n == _N_ZERO:
                return False  # no leading zeros
            elif n in (_N_DOT, _N_FRAC):
                self._num = _N_FRAC
            elif n in (_N_E, _N_ESIGN, _N_EXP):
                self._num = _N_EXP
            return True
        if ch == "." and n in (_N_ZERO, _N_INT):
            self._num = _N_DOT
            return True
        if ch in "eE" and n in (_N_ZERO, _N_INT, _N_FRAC):
            self._num = _N_E
            return True
        if ch in "+-" and n == _N_E:
            self._num = _N_ESIGN
            return True
        return False

    def _close(self, opener: str) -> bool:
        if not self._stack or self._stack[-1] != opener:
            return False
        self._stack.pop()
        self.events.append((VALUE_END_AT, len(self._stack)))
        self._value_done()
        return True

    def _value_done(self) -> None:
        self._state = _AFTER if self._stack else _DONE
