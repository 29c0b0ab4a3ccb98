"""What a request asks its output to follow: `GuidedDecodingParams` (vLLM's name and fields).

Imports only stdlib, msgspec and `aserve.config` (stdlib only), so `aserve.sampling_params` can
import it at module level.
`validate()` raises `aserve.sampling_params.SamplingParamsError`, imported lazily inside the
method: that keeps `sampling_params -> structured_outputs.params` a one-way import (no cycle).

Whether a spec *compiles* (a schema xgrammar rejects, a regex that does not parse) is not decided
here: that needs the grammar backend, see `aserve.structured_outputs.backend.GrammarCompiler`,
whose `GrammarCompileError` names the same fields as `field_name()` below.
"""

from __future__ import annotations

import importlib.util
import json as _json
from typing import Any

import msgspec

from aserve.config.guided_decoding import (
    GUIDED_DECODING_BACKENDS,
    GUIDED_OPTION_FIELDS,
    UNSHIPPED_GUIDED_BACKENDS,
    split_backend_options,
)
from aserve.config.schema import StructuredOutputsConfig

# The kinds of constraint, in the order they are reported; exactly one must be given.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

# kind -> the request field that carries it on the OpenAI server (vLLM's spellings); errors name these.
_FIELD_NAMES = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
    "json_object": "response_format",
    "structural_tag": "structural_tag",
    "whitespace_pattern": "guided_whitespace_pattern",
    "backend": "guided_decoding_backend",
}

# Names `--guided-decoding-backend` / `guided_decoding_backend` accept: GUIDED_DECODING_BACKENDS;
# vLLM backends we recognise but do not ship fail with a hint (UNSHIPPED_GUIDED_BACKENDS).
__all__ = ["GUIDED_DECODING_BACKENDS", "GrammarCompileError", "GuidedDecodingParams", "StructuredOutputsParams",
           "check_backend_name", "field_name"]


class GrammarCompileError(ValueError):
    """A spec that the grammar backend cannot compile; `field` names the request field
    (e.g. "guided_json", "guided_regex"), so intake can answer 400 with `param` = field.
    Defined here (not in a backend module) so the engine can catch it without importing xgrammar."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def field_name(kind: str) -> str:
    """The request field (vLLM spelling) that carries `kind`, e.g. "json" -> "guided_json"."""
    return _FIELD_NAMES.get(kind, kind)


def check_backend_name(name: str) -> str:
    """Normalises a guided-decoding backend name; raises ValueError with a user-facing message.

    Accepts "auto", "xgrammar" and "guidance" (case-insensitive), with vLLM's option suffix such as
    "xgrammar:no-fallback,disable-any-whitespace" (see aserve/config/guided_decoding.py; an unknown
    option is an error naming it; `GuidedDecodingParams.resolved` applies them); "guidance" needs the
    llguidance package. "outlines" and "lm-format-enforcer" are vLLM backends aserve does not ship:
    a clear error. Returns the bare lower-case name.
    """
    bare, _ = split_backend_options(name)
    if bare in UNSHIPPED_GUIDED_BACKENDS:
        raise ValueError(
            f"guided decoding backend {bare!r} is not supported by aserve; "
            "use 'auto', 'xgrammar' or 'guidance'")
    if bare not in GUIDED_DECODING_BACKENDS:
        raise ValueError(f"unknown guided decoding backend {name!r}; use 'auto', 'xgrammar' or 'guidance'")
    if bare == "guidance" and importlib.util.find_spec("llguidance") is None:
        raise ValueError("guided decoding backend 'guidance' needs the llguidance package "
                         "(pip install llguidance); use 'auto' or 'xgrammar'")
    return bare


def _error(field: str, message: str) -> Exception:
    from aserve.sampling_params import SamplingParamsError  # lazy: sampling_params imports this module

    return SamplingParamsError(field, message)


class GuidedDecodingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One output constraint. Mirrors vLLM's `GuidedDecodingParams` / `StructuredOutputsParams`.

    Exactly one of `json` (a JSON schema, as a dict or a JSON string; a pydantic model class is
    converted with `model_json_schema()`), `regex`, `choice` (the output is exactly one of these
    strings), `grammar` (xgrammar EBNF, GBNF-like: `root ::= ...`), `json_object=True` (any JSON
    object/value) or `structural_tag` (xgrammar's structural-tag JSON, a string or dict) is set.

    Options: `backend` (None = the engine's `--guided-decoding-backend`), `whitespace_pattern`
    (JSON only; a regex for the whitespace between JSON tokens: xgrammar supports only "" = none,
    the guidance backend any pattern, and "auto" picks guidance for a non-empty one),
    `disable_any_whitespace` (JSON compact: no free whitespace between tokens),
    `disable_additional_properties` (a JSON schema's objects that do not say `additionalProperties`
    get `false`: only the listed properties are generated. xgrammar compiles schemas that way anyway
    (which satisfies OpenAI's `strict: true`); the guidance backend follows the schema as written
    unless this is set), `disable_fallback` ("auto" keeps the spec on xgrammar instead of routing
    what only guidance serves, a non-empty `whitespace_pattern`, to guidance). A `backend` with
    vLLM's option suffix ("xgrammar:disable-any-whitespace") sets these too (see `resolved`);
    the engine's `--structured-outputs-config` options apply to every request (`resolved`).
    `reasoning_end_token_ids` (the grammar starts after the output holds these ids: the server
    sets it to `</think>`'s ids under `--reasoning-parser`).

    The constructor normalises (pydantic class -> dict, structural_tag dict -> str) but does not
    validate: call `validate()` (SamplingParams does, at intake).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    backend: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False
    # Set by the server when a reasoning parser is on: the grammar applies only once the output
    # holds these token ids (the end-of-reasoning marker, `</think>`); None = from the first token.
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        schema_of = getattr(self.json, "model_json_schema", None)
        if callable(schema_of):  # a pydantic model class or instance, as vLLM accepts
            self.json = schema_of()
        if isinstance(self.structural_tag, dict):
            self.structural_tag = _json.dumps(self.structural_tag)
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)

    def resolved(self, defaults: StructuredOutputsConfig | None = None) -> GuidedDecodingParams:
        """This validated spec as the grammar backends compile it: a `backend` option suffix folded
        into the option fields (`backend` left bare), and the engine-wide options of `defaults` turned
        on, except compact JSON for a spec that brings its own `whitespace_pattern`. Options only
        ever turn on (a request cannot switch off what the engine enforces). Returns self when
        nothing changes; ValueError for an unknown suffix option (`validate()` reports it first)."""
        changes: dict[str, Any] = {}
        if self.backend is not None and ":" in self.backend:
            bare, options = split_backend_options(self.backend)
            changes["backend"] = bare
            changes.update({k: True for k in options if not getattr(self, k)})
        if defaults is not None:
            for name in GUIDED_OPTION_FIELDS:
                if getattr(defaults, name) and not getattr(self, name):
                    if name == "disable_any_whitespace" and self.whitespace_pattern is not None:
                        continue
                    changes[name] = True
        return msgspec.structs.replace(self, **changes) if changes else self

    def kinds_given(self) -> list[str]:
        """The constraint kinds that are set (`json_object=False` counts as not set)."""
        given = []
        for kind in KINDS:
            value = getattr(self, kind)
            if value is None or (kind == "json_object" and value is False):
                continue
            given.append(kind)
        return given

    @property
    def kind(self) -> str:
        """The one constraint kind; only meaningful after `validate()` passed."""
        return self.kinds_given()[0]

    def validate(self) -> None:
        """Raises SamplingParamsError(field, message) unless exactly one well-formed kind is set.

        Checks shape only (types, emptiness, JSON syntax of a string schema, backend name);
        whether the spec compiles is the grammar backend's check.
        """
        given = self.kinds_given()
        if not given:
            raise _error("guided_decoding", "no constraint given: set one of json, regex, choice, "
                                            "grammar, json_object or structural_tag")
        if len(given) > 1:
            raise _error(field_name(given[1]), "only one kind of guided decoding may be given, got "
                         + ", ".join(field_name(k) for k in given))
        kind = given[0]
        field = field_name(kind)
        value = getattr(self, kind)
        if kind == "json":
            self._validate_json_schema(field, value)
        elif kind == "choice":
            if not isinstance(value, list) or not value:
                raise _error(field, "must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in value):
                raise _error(field, "every choice must be a non-empty string")
        elif kind == "json_object":
            if value is not True:
                raise _error(field, "json_object must be true or unset")
        elif kind == "structural_tag":
            if not isinstance(value, str) or not value.strip():
                raise _error(field, "must be a non-empty JSON string")
            try:
                _json.loads(value)
            except ValueError as e:
                raise _error(field, f"is not valid JSON: {e}") from None
        elif not isinstance(value, str) or not value:  # regex, grammar
            raise _error(field, "must be a non-empty string")
        if self.whitespace_pattern is not None:
            if kind not in ("json", "json_object"):
                raise _error(field_name("whitespace_pattern"), "only applies to guided_json / json_object")
            if not isinstance(self.whitespace_pattern, str):
                raise _error(field_name("whitespace_pattern"), "must be a string")
        if self.reasoning_end_token_ids is not None:
            ids = self.reasoning_end_token_ids
            if not (isinstance(ids, list) and ids and all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63 for t in ids)):
                raise _error("reasoning_end_token_ids", "must be a non-empty list of token ids")
        if self.backend is not None:
            try:
                check_backend_name(self.backend)
            except ValueError as e:
                raise _error(field_name("backend"), str(e)) from None

    @staticmethod
    def _validate_json_schema(field: str, value: Any) -> None:
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as e:
                raise _error(field, f"is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise _error(field, "must be a JSON schema (an object)")

    def spec_key(self) -> tuple:
        """A hashable key that is equal for specs that compile to the same grammar.

        JSON schemas are canonicalised (sorted keys, compact), so the same schema sent as a dict
        or as a string shares one cache entry. `backend` and `disable_fallback` are not part of
        the key (a compiler serves one backend).
        """
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            schema = _json.loads(value) if isinstance(value, str) else value
            canonical: Any = _json.dumps(schema, sort_keys=True, separators=(",", ":"))
        elif kind == "structural_tag":
            canonical = _json.dumps(_json.loads(value), sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            canonical = tuple(value)
        else:
            canonical = value
        json_options = (self.whitespace_pattern, self.disable_any_whitespace) if kind in (
            "json", "json_object") else ()
        if kind == "json":
            json_options += (self.disable_additional_properties,)
        return (kind, canonical, *json_options)


# vLLM's newer name for the same thing.
StructuredOutputsParams = GuidedDecodingParams
