"""The `guidance` backend: llguidance grammars and matchers behind the same contracts as xgrammar's.

`GuidanceCompiler` mirrors `backend.GrammarCompiler` (compile -> cached grammar, new_state,
state_for) and `GuidanceState` mirrors `state.GrammarState` (accept_token(s), is_completed,
is_terminated, rollback, reset, rebuild, fill_bitmask). Bitmasks use the same layout, so
`bitmask.BitmaskBuilder` fills both kinds of state into one tensor.

Differences from xgrammar: JSON whitespace may follow any `whitespace_pattern`; a JSON schema's
objects allow properties it does not list unless it says `additionalProperties: false` (or the spec
sets `disable_additional_properties`, which closes them as xgrammar does); `structural_tag`
is not supported (GrammarCompileError naming it); `grammar` accepts GBNF/EBNF (`root ::= ...`,
converted to Lark) and Lark. Runner side only (llguidance's torch helpers import torch).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch

from aserve.structured_outputs.cache import SpecCache
from aserve.structured_outputs.params import GrammarCompileError, GuidedDecodingParams, field_name
from aserve.structured_outputs.state import ReplayableState, fill_stop_only


class GuidanceGrammar:
    """A validated llguidance grammar (its serialized spec) for one tokenizer."""

    __slots__ = ("spec",)

    def __init__(self, spec: str):
        self.spec = spec


class GuidanceCompiler:
    """Compiles specs for one tokenizer with llguidance; LRU of the last `max_cached` grammars.

    `vocab_size` is the model's logits width (ids past the tokenizer are never allowed);
    `stop_token_ids` are the ids a complete grammar allows (None: the tokenizer's EOS).
    """

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 max_cached: int = 256):
        stops = list(stop_token_ids) if stop_token_ids else None
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stops)
        self.vocab_size = vocab_size
        self.stop_token_ids = stops if stops is not None else [int(self.ll_tokenizer.eos_token)]
        self._cache = SpecCache(max_cached)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def compile(self, params: GuidedDecodingParams) -> GuidanceGrammar:
        """The grammar for a validated spec (cached by spec); raises GrammarCompileError."""
        return self._cache.get_or_compile(params.spec_key(), lambda: self._compile_uncached(params))

    def _compile_uncached(self, params: GuidedDecodingParams) -> GuidanceGrammar:
        spec = grammar_spec(params)
        error = llguidance.LLMatcher.validate_grammar(spec, self.ll_tokenizer)
        if error:
            raise GrammarCompileError(field_name(params.kind), f"cannot compile: {error.strip()}")
        return GuidanceGrammar(spec)

    def new_state(self, compiled: GuidanceGrammar) -> GuidanceState:
        """A fresh matcher at the start of `compiled`."""
        return GuidanceState(self.ll_tokenizer, compiled, self.stop_token_ids)

    def state_for(self, params: GuidedDecodingParams, output_token_ids: Sequence[int] = (),
                  stop_token_ids: Sequence[int] | None = None) -> GuidanceState:
        """compile + new_state + replay of the tokens already generated (a resumed request);
        `stop_token_ids` (None: the compiler's) are what the completed grammar allows."""
        compiled = self.compile(params)
        state = GuidanceState(self.ll_tokenizer, compiled, stop_token_ids or self.stop_token_ids)
        if output_token_ids:
            state.rebuild(output_token_ids)
        return state


def grammar_spec(params: GuidedDecodingParams) -> str:
    """llguidance's serialized grammar for a validated spec (no tokenizer needed); raises
    GrammarCompileError for what cannot be expressed or parsed."""
    kind = params.kind
    field = field_name(kind)
    value = getattr(params, kind)
    try:
        if kind in ("json", "json_object"):
            schema = '{"type": "object"}' if kind == "json_object" else value
            if kind == "json" and params.disable_additional_properties:
                schema = close_objects(json.loads(schema) if isinstance(schema, str) else schema)
            schema = schema if isinstance(schema, str) else json.dumps(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_defaults(params))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            return llguidance.grammar_from("choice", list(value))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarCompileError(field, f"cannot compile: {e}") from None
    raise GrammarCompileError(field, "is not supported by the guidance backend; use xgrammar")


# Keywords whose value is a subschema, a list of them, or a name -> subschema map (JSON Schema 2020-12).
_SUBSCHEMA = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema (type "object", or one with `properties`)
    that does not say `additionalProperties` gets `false`, as vLLM's disable_additional_properties
    does; `enum` / `const` values and other non-schema keywords are left alone."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_defaults(params: GuidedDecodingParams) -> dict[str, Any]:
    compact = params.disable_any_whitespace or params.whitespace_pattern == ""
    defaults: dict[str, Any] = {"whitespace_flexible": not compact}
    if params.whitespace_pattern:
        defaults["whitespace_pattern"] = params.whitespace_pattern
    return defaults


class GuidanceState(ReplayableState):
    """A per-request llguidance matcher with GrammarState's contract; not thread-safe.

    llguidance stops a matcher by itself when nothing can follow; here, as with xgrammar, a state
    is terminated only once a stop token has been accepted (so the runner's loop is the same).
    """

    __slots__ = ("_terminated", "matcher", "num_accepted", "stop_token_ids")

    def __init__(self, ll_tokenizer: Any, compiled: GuidanceGrammar, stop_token_ids: Sequence[int]):
        self.matcher = llguidance.LLMatcher(ll_tokenizer, compiled.spec)
        self.stop_token_ids = list(stop_token_ids)
        self.num_accepted = 0
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False (and no change) if the grammar does not allow it."""
        token_id = int(token_id)
        if self._terminated or self.matcher.is_error():
            return False
        if token_id in self.stop_token_ids:
            if not (self.matcher.is_accepting() or self.matcher.is_stopped()):
                return False
        elif self.matcher.validate_tokens([token_id]) != 1:
            return False
        if not self.matcher.consume_token(token_id):
            return False
        self.num_accepted += 1
        self._terminated = token_id in self.stop_token_ids
        return True

    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""
        return self._terminated

    def is_completed(self) -> bool:
        """True when the text so far is a complete sentence of the grammar (or terminated)."""
        return self._terminated or self.matcher.is_accepting() or self.matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self._terminated = False

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self.matcher.reset()
        self.num_accepted = 0
        self._terminated = False

    def fill_bitmask(self, bitmask, row: int = 0) -> None:
        """Writes the allowed next tokens into `bitmask[row]`; a terminated state allows only stops."""
        if self._terminated:
            fill_stop_only(bitmask, row, self.stop_token_ids)
        else:
            llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)


def fill_batch(executor: Any, rows: Sequence[int], states: Sequence[GuidanceState], bitmask) -> None:
    """Fills the rows of live (not terminated) guidance states in one parallel llguidance call."""
    pairs = [(s.matcher, int(r)) for r, s in zip(rows, states)]
    if pairs:
        llguidance.torch.fill_next_token_bitmask_par(executor, pairs, bitmask)


def make_executor(max_threads: int | None = None) -> Any:
    """llguidance's thread pool for `fill_batch`."""
    return llguidance.LLExecutor(max_threads) if max_threads else llguidance.LLExecutor()
