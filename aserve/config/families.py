"""Per-family config.json fields, parsed in one place into small typed structs.

`ArchConfig` holds what every decoder has (sizes, heads, RoPE, norms' epsilon, windows); what only
some families have lives in a frozen struct per family, in `ArchConfig.family`, built here by the
parser registered for the architecture (`FAMILY_PARSERS`). Families whose config.json spells the
common fields differently (GPT-2's `n_embd`, OPT's `ffn_dim`) are renamed to the common spelling by
`normalize_keys` before anything reads them. A field this engine cannot honour raises ConfigError
naming the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aserve.config.errors import ConfigError

# Architecture -> {its config.json key: the common key ArchConfig reads}.
KEY_ALIASES: dict[str, dict[str, str]] = {}


def normalize_keys(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the architecture's own spellings of the common keys renamed (the common spelling
    wins when both are present)."""
    aliases = KEY_ALIASES.get(architecture)
    if not aliases:
        return cfg
    out = dict(cfg)
    for own, common in aliases.items():
        if own in cfg and common not in cfg:
            out[common] = cfg[own]
    return out


def require_key(cfg: dict[str, Any], key: str, allowed: Callable[[Any], bool], what: str) -> None:
    """ConfigError naming `key` unless `allowed(cfg.get(key))`."""
    if not allowed(cfg.get(key)):
        raise ConfigError(f"--model: config.json's {key}={cfg.get(key)!r}: {what}")


# Architecture -> parser of its family struct (None: the family has no extra fields).
FAMILY_PARSERS: dict[str, Callable[[dict[str, Any]], Any]] = {}


def parse_family_fields(architecture: str, cfg: dict[str, Any]) -> Any:
    """The family struct for `architecture` (None when it has no extra fields)."""
    parser = FAMILY_PARSERS.get(architecture)
    return None if parser is None else parser(cfg)

