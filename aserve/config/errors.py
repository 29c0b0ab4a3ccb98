"""`ConfigError`, the one error type for bad engine arguments and unsupported model configs."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or combination is invalid; the message starts with the flag it blames
    (`--block-size: ...`) or, for a model's config.json, names the offending key."""


def require(ok: bool, arg: str, msg: str) -> None:
    """Raise `ConfigError("--arg-name: msg")` unless `ok`; `arg` is the EngineArgs field name."""
    if not ok:
        raise ConfigError(f"{flag_name(arg)}: {msg}")


def flag_name(arg: str) -> str:
    """`max_model_len` -> `--max-model-len` (the CLI spelling of an EngineArgs field)."""
    return "--" + arg.replace("_", "-")
