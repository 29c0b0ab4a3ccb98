"""Engine errors the server maps to HTTP answers (a light module: importing it loads no engine)."""

from __future__ import annotations


class EngineSleepingError(RuntimeError):
    """Sleep mode: the model is asleep (POST /wake_up); new requests fail with this (HTTP 503)."""


class EngineBusyError(RuntimeError):
    """The engine cannot sleep now: requests are unfinished (nothing was done; HTTP 409)."""
