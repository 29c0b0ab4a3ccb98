"""Compiling `GuidedDecodingParams` into xgrammar grammars, cached by spec (runner side).

Imports xgrammar, and `import xgrammar` imports torch: only the runner (or a worker thread
that is allowed torch) may import this module. The engine/server use `params` only.

Thread-safety: `GrammarCompiler.compile` may be called from several threads at once (intake
threads, the runner); concurrent requests for the same spec wait for one compilation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr

from aserve.structured_outputs.cache import SpecCache
from aserve.structured_outputs.params import GrammarCompileError, GuidedDecodingParams, field_name
from aserve.structured_outputs.state import GrammarState

_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


__all__ = ["GrammarCompileError", "GrammarCompiler", "check_compiles", "choice_grammar", "load_tokenizer_info"]


def _clean(error: Exception) -> str:
    """xgrammar's C++ errors carry a time stamp and source location; keep the message."""
    text = str(error).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(error).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (literals JSON-escaped)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def load_tokenizer_info(tokenizer: Any, vocab_size: int,
                        stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of a HF tokenizer, padded to the model's `vocab_size`.

    `vocab_size` is the logits width (config.vocab_size), which may exceed the tokenizer's length;
    ids past the tokenizer are never allowed. `stop_token_ids` are the ids a completed grammar
    allows (the model's EOS ids); None lets xgrammar read them from the tokenizer.
    """
    stops = list(stop_token_ids) if stop_token_ids else None
    if type(tokenizer).__name__ == "MistralCommonBackend":  # --tokenizer-mode mistral: no HF backend to read
        from aserve.structured_outputs.mistral_vocab import mistral_tokenizer_info

        return mistral_tokenizer_info(tokenizer, vocab_size, stops)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)


def check_compiles(params: GuidedDecodingParams) -> None:
    """Intake check without a tokenizer: parses the spec into an xgrammar `Grammar` (no token
    tables), raising GrammarCompileError(field, message) where `GrammarCompiler.compile` would.

    Much cheaper than a full compile (no per-token work); meant for request intake in a worker
    thread, so a bad spec is a 400 naming its field instead of a failed request in the runner.
    """
    kind = params.kind
    value = getattr(params, kind)
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(value, **GrammarCompiler._json_options(params))
        elif kind == "json_object":
            GrammarCompiler._json_options(params)
        elif kind == "regex":
            xgr.Grammar.from_regex(value)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_grammar(value))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(value)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(value)
    except GrammarCompileError:
        raise
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarCompileError(field_name(kind), f"cannot compile: {_clean(e)}") from None


class GrammarCompiler:
    """Compiles specs for one tokenizer with xgrammar; keeps the last `max_cached` grammars (LRU).

    `compile(params)` returns the same `xgr.CompiledGrammar` object for equal `spec_key()`s while
    it stays cached, and raises `GrammarCompileError(field, message)` when the spec does not
    compile. `new_state(compiled)` makes a fresh per-request matcher.
    """

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 max_cached: int = 256, max_threads: int = 2,
                 tokenizer_info: xgr.TokenizerInfo | None = None):
        self.tokenizer_info = tokenizer_info or load_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = self.tokenizer_info.vocab_size
        self.stop_token_ids = list(self.tokenizer_info.stop_token_ids)
        # Our LRU keyed by spec replaces xgrammar's own cache (which is keyed by the raw arguments).
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)
        self._cache = SpecCache(max_cached)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def compile(self, params: GuidedDecodingParams) -> xgr.CompiledGrammar:
        """The compiled grammar for a validated spec (cached); raises GrammarCompileError."""
        return self._cache.get_or_compile(params.spec_key(), lambda: self._compile_uncached(params))

    def _compile_uncached(self, params: GuidedDecodingParams) -> xgr.CompiledGrammar:
        kind = params.kind
        field = field_name(kind)
        value = getattr(params, kind)
        try:
            if kind == "json":  # strict_mode (the default) closes objects: disable_additional_properties holds
                return self._compiler.compile_json_schema(value, **self._json_options(params))
            if kind == "json_object":  # OpenAI's json_object: any JSON object (not an array)
                return self._compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                          **self._json_options(params))
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "choice":
                return self._compiler.compile_grammar(choice_grammar(value))
            if kind == "grammar":
                return self._compiler.compile_grammar(value)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(value)
        except GrammarCompileError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar: RuntimeError and subclasses
            raise GrammarCompileError(field, f"cannot compile: {_clean(e)}") from None
        raise GrammarCompileError(field, f"unknown guided decoding kind {kind!r}")

    @staticmethod
    def _json_options(params: GuidedDecodingParams) -> dict[str, Any]:
        """xgrammar's whitespace options: free whitespace by default; none when
        `disable_any_whitespace` or `whitespace_pattern == ""` (other patterns are not supported)."""
        pattern = params.whitespace_pattern
        if pattern is not None and pattern != "":
            raise GrammarCompileError(field_name("whitespace_pattern"),
                                      "xgrammar supports only the empty whitespace pattern \"\"; "
                                      "use disable_any_whitespace for compact JSON")
        compact = params.disable_any_whitespace or pattern == ""
        return {"any_whitespace": not compact}

    def new_state(self, compiled: xgr.CompiledGrammar, *, max_rollback_tokens: int = 0) -> GrammarState:
        """A fresh matcher at the start of `compiled`; completes only on a stop token."""
        return GrammarState(compiled, self.stop_token_ids, max_rollback_tokens=max_rollback_tokens)

    def state_for(self, params: GuidedDecodingParams, output_token_ids: Sequence[int] = (),
                  stop_token_ids: Sequence[int] | None = None) -> GrammarState:
        """compile + new_state + replay of the tokens already generated (a resumed request);
        `stop_token_ids` (None: the compiler's) are what the completed grammar allows."""
        compiled = self.compile(params)
        state = GrammarState(compiled, stop_token_ids) if stop_token_ids else self.new_state(compiled)
        if output_token_ids:
            state.rebuild(output_token_ids)
        return state
