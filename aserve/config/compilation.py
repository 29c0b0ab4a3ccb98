"""`-O` / `--compilation-config` (vLLM's names): how much of the model runs compiled.

The value is an int level or an object `{"level": 0|3, "compile_sizes": [int, ...], "backend":
"inductor"|"aot_eager"|"eager"}` (a JSON string on the command line; `backend` is torch.compile's, for
the CPU path: `eager` traces the graph without generating code, which tests use). Level 0 runs everything eagerly (`--enforce-eager` means the same). Level 3:
on CUDA, decode batches replay CUDA graphs (the CUDA default); on CPU, decode-only batches of exactly
a size in `compile_sizes` (default `[1]`, where per-op overhead dominates) run an inductor-compiled
forward, compiled at start-up (tens of seconds per size on 2 cores; inductor caches the result on
disk). The CPU default is level 0, for a fast start-up. vLLM's internal levels 1 and 2 and its other
keys are refused at start-up rather than ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aserve.config.errors import ConfigError

LEVELS = (0, 3)
BACKENDS = ("inductor", "aot_eager", "eager")
_KEYS = ("level", "compile_sizes", "backend")
CPU_DEFAULT_COMPILE_SIZES = (1,)
_FLAG = "--compilation-config"


@dataclass(frozen=True)
class CompilationConfig:
    """Resolved: `level` 0 or 3; `compile_sizes` the CPU decode batch sizes compiled (empty: none)."""

    level: int = 0
    compile_sizes: tuple[int, ...] = ()
    backend: str = "inductor"


def parse_compilation_config(value: int | str | dict[str, Any] | None) -> dict[str, Any]:
    """The user's value as a dict of known keys (empty for None); ConfigError naming the flag."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if text.lstrip("-").isdigit() else json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{_FLAG}: expected a level (int) or a JSON object, got {text!r} ({exc})") from None
    if isinstance(value, bool) or not isinstance(value, int | dict):
        raise ConfigError(f"{_FLAG}: expected a level (int) or an object, got {type(value).__name__}")
    spec = {"level": value} if isinstance(value, int) else dict(value)
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown:
        raise ConfigError(f"{_FLAG}: {', '.join(unknown)} not implemented (implemented keys: {', '.join(_KEYS)})")
    level = spec.setdefault("level", 3)  # an object without a level asks for compilation
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        raise ConfigError(f"{_FLAG}: level must be 0 or 3 (vLLM's internal levels 1 and 2 are not "
                          f"implemented), got {level!r}")
    if spec.get("backend", "inductor") not in BACKENDS:
        raise ConfigError(f"{_FLAG}: backend must be one of {BACKENDS}, got {spec['backend']!r}")
    sizes = spec.get("compile_sizes")
    if sizes is not None:
        if not isinstance(sizes, list | tuple) or not sizes or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes):
            raise ConfigError(f"{_FLAG}: compile_sizes must be a non-empty list of positive ints, got {sizes!r}")
        spec["compile_sizes"] = tuple(sorted(set(sizes)))
    return spec


def resolve_compilation(value: int | str | dict[str, Any] | None, enforce_eager: bool, device: str,
                        max_num_seqs: int) -> CompilationConfig:
    """The level and sizes for `device` ("cpu" | "cuda"); see the module docstring."""
    spec = parse_compilation_config(value)
    if enforce_eager and spec.get("level", 0) != 0:
        raise ConfigError(f"{_FLAG}: --enforce-eager means level 0; drop one of them")
    level = spec.get("level", 0 if (enforce_eager or device != "cuda") else 3)
    if device == "cuda":
        if "compile_sizes" in spec or "backend" in spec:
            raise ConfigError(f"{_FLAG}: compile_sizes and backend are implemented for CPU only (CUDA uses "
                              "CUDA graphs)")
        return CompilationConfig(level=level)
    if level == 0:
        return CompilationConfig(level=0)
    sizes = spec.get("compile_sizes", CPU_DEFAULT_COMPILE_SIZES)
    if max(sizes) > max_num_seqs:
        raise ConfigError(f"{_FLAG}: compile_sizes {list(sizes)} exceed --max-num-seqs {max_num_seqs}")
    return CompilationConfig(level=level, compile_sizes=sizes, backend=spec.get("backend", "inductor"))
