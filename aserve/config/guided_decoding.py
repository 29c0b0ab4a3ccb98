"""vLLM's guided-decoding backend spellings: `backend[:option,option,...]` and the option names.

`--guided-decoding-backend xgrammar:disable-any-whitespace,no-fallback` (and a request's
`guided_decoding_backend`) name a backend and options; `split_backend_options` parses them into the
bare backend name and the `StructuredOutputsConfig` / `GuidedDecodingParams` fields they set. The
same fields are `--structured-outputs-config` keys; `resolve_structured_outputs` combines both flags.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from aserve.config.errors import ConfigError, flag_name, require
from aserve.config.schema import StructuredOutputsConfig

# What aserve serves, and vLLM backends it refuses by name.
GUIDED_DECODING_BACKENDS = ("auto", "xgrammar", "guidance")
UNSHIPPED_GUIDED_BACKENDS = ("outlines", "lm-format-enforcer")

# The option fields, which StructuredOutputsConfig and GuidedDecodingParams share:
#   disable_any_whitespace: JSON grammars allow no free whitespace between tokens (compact JSON);
#   disable_additional_properties: a JSON schema's objects without `additionalProperties` get false;
#   disable_fallback: "auto" never routes a spec to guidance; it stays with xgrammar.
GUIDED_OPTION_FIELDS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback")

# vLLM's suffix spellings (`xgrammar:no-fallback`) -> the field each sets; vLLM spelled the
# additional-properties option both ways over its versions.
BACKEND_OPTIONS = {
    "disable-any-whitespace": "disable_any_whitespace",
    "disable-additional-properties": "disable_additional_properties",
    "no-additional-properties": "disable_additional_properties",
    "no-fallback": "disable_fallback",
    "disable-fallback": "disable_fallback",
}


def split_backend_options(value: str) -> tuple[str, dict[str, bool]]:
    """`"xgrammar:disable-any-whitespace,no-fallback"` -> `("xgrammar", {"disable_any_whitespace": True,
    "disable_fallback": True})`. The backend name is lower-cased and not checked here; ValueError
    naming every unknown option (and the known ones) otherwise."""
    text = str(value).strip()
    bare, _, suffix = text.partition(":")
    options = [o.strip().lower() for o in suffix.split(",") if o.strip()] if suffix else []
    unknown = [o for o in options if o not in BACKEND_OPTIONS]
    if unknown:
        raise ValueError(f"unknown guided decoding option(s) {unknown} in {text!r}; "
                         f"options: {sorted(BACKEND_OPTIONS)}")
    return bare.strip().lower(), {BACKEND_OPTIONS[o]: True for o in options}

def resolve_structured_outputs(guided_decoding_backend: str,
                               structured_outputs_config: dict[str, Any] | None) -> StructuredOutputsConfig:
    """--guided-decoding-backend (vLLM's `backend:option,...` form) and --structured-outputs-config
    (its `backend` wins; its option keys and the suffix options add up) as one config. ConfigError
    naming the flag for: an unknown key or option, a non-boolean option, a key set false that a
    suffix sets, outlines / lm-format-enforcer (not shipped), unknown backends, guidance without
    llguidance. `reasoning_parser` is the server's (`--reasoning-parser`): checked there."""
    arg, value = "guided_decoding_backend", guided_decoding_backend
    try:
        bare, options = split_backend_options(value)
    except ValueError as e:
        raise ConfigError(f"{flag_name(arg)}: {e}") from None
    keys = structured_outputs_config
    if keys is not None:
        known = {"backend", "reasoning_parser", *GUIDED_OPTION_FIELDS}
        unknown = set(keys) - known
        require(not unknown, "structured_outputs_config",
                f"unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        if "backend" in keys:
            arg, value = "structured_outputs_config", keys["backend"]
            require(isinstance(value, str), arg, f"backend must be a string, got {value!r}")
            try:
                bare, more = split_backend_options(value)
            except ValueError as e:
                raise ConfigError(f"{flag_name(arg)}: {e}") from None
            options.update(more)
        for name in GUIDED_OPTION_FIELDS:
            if name in keys:
                require(isinstance(keys[name], bool), "structured_outputs_config",
                        f"{name} must be true or false, got {keys[name]!r}")
                require(keys[name] or not options.get(name), "structured_outputs_config",
                        f"{name}=false contradicts the backend option that sets it "
                        f"(--guided-decoding-backend {guided_decoding_backend!r})")
                options[name] = options.get(name, False) or keys[name]
        parser = keys.get("reasoning_parser")
        require(parser is None or isinstance(parser, str), "structured_outputs_config",
                f"reasoning_parser must be a string, got {parser!r}")
    require(bare not in UNSHIPPED_GUIDED_BACKENDS, arg,
            f"the {bare!r} backend is not supported by aserve; use 'auto', 'xgrammar' or 'guidance'")
    require(bare in GUIDED_DECODING_BACKENDS, arg,
            f"must be one of {GUIDED_DECODING_BACKENDS}, got {value!r}")
    require(bare != "guidance" or importlib.util.find_spec("llguidance") is not None, arg,
            "'guidance' needs the llguidance package (pip install llguidance)")
    return StructuredOutputsConfig(backend=bare, **options)
