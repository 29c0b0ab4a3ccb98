"""vLLM's guided-decoding backend spellings: `backend[:option,option,...]` and the option names.

`--guided-decoding-backend xgrammar:disable-any-whitespace,no-fallback` (and a request's
`guided_decoding_backend`) name a backend and options; `split_backend_options` parses them into the
bare backend name and the `StructuredOutputsConfig` / `GuidedDecodingParams` fields they set. The
same fields are `--structured-outputs-config` keys. Standard library only (the config layer).
"""

from __future__ import annotations

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
