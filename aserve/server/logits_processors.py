"""Logits processors named in requests (vLLM's `--logits-processor-pattern`).

A request's `logits_processors` lists qualified names (`"pkg.module.name"`) or
`{"qualname": ..., "args": [...], "kwargs": {...}}`. Only names matching the server's pattern
(`re.match`, anchored at the start as vLLM) are imported; with no pattern, none is allowed. A bare
name must be a processor itself (`f(output_token_ids, logits)` or `f(prompt_token_ids,
output_token_ids, logits)`); with args or kwargs it is called with them to make one (a factory or a
class). Every failure is a SamplingParamsError naming `logits_processors` (a 400).
"""

from __future__ import annotations

import importlib
import re
from typing import Any

from aserve.sampling_params import SamplingParamsError

_FIELD = "logits_processors"


def resolve_logits_processors(specs: list[str | dict[str, Any]] | None, pattern: str | None) -> list[Any] | None:
    """The processors `specs` name (None when none are asked for)."""
    if not specs:
        return None
    if pattern is None:
        raise SamplingParamsError(_FIELD, "this server allows no logits processors by name "
                                          "(start it with --logits-processor-pattern REGEX)")
    processors = []
    for spec in specs:
        qualname, args, kwargs = _parse(spec)
        if not re.match(pattern, qualname):
            raise SamplingParamsError(_FIELD, f"{qualname!r} is not allowed by this server's "
                                              "--logits-processor-pattern")
        obj = _import(qualname)
        if args or kwargs:
            try:
                obj = obj(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the user's constructor: report it on the request
                raise SamplingParamsError(_FIELD, f"constructing {qualname!r} failed: {type(e).__name__}: {e}") from None
        if not callable(obj):
            raise SamplingParamsError(_FIELD, f"{qualname!r} is not callable")
        processors.append(obj)
    return processors


def _parse(spec: str | dict[str, Any]) -> tuple[str, list, dict]:
    if isinstance(spec, str):
        return spec, [], {}
    unknown = set(spec) - {"qualname", "args", "kwargs"}
    qualname, args, kwargs = spec.get("qualname"), spec.get("args") or [], spec.get("kwargs") or {}
    if unknown or not isinstance(qualname, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise SamplingParamsError(_FIELD, "each entry is a qualified name or {\"qualname\": str, \"args\": list, "
                                          "\"kwargs\": object}")
    return qualname, args, kwargs


def _import(qualname: str) -> Any:
    module_name, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise SamplingParamsError(_FIELD, f"cannot import {qualname!r}: {e}") from None
