"""`StructuredOutputCompilers`: the runner's one entry point; routes each spec to a backend.

Backend choice per request: `params.backend` if set, else the engine's default
(`--guided-decoding-backend`). "auto" means xgrammar, except for what only guidance can serve
(a non-empty JSON `whitespace_pattern`) when llguidance is installed, unless `disable_fallback`
(the request's, or the engine's `no-fallback` option) keeps it on xgrammar. Compilers are built
lazily, one per backend, and each caches its grammars by spec.

Every entry point takes the engine's defaults as a `StructuredOutputsConfig` (or, as a shorthand, a
backend string, which may carry vLLM's `:option` suffix) and compiles `params.resolved(defaults)`:
the engine-wide options (compact JSON, closed objects, no fallback) reach every grammar here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from aserve.config.guided_decoding import split_backend_options
from aserve.config.schema import StructuredOutputsConfig
from aserve.structured_outputs.cache import SpecCache
from aserve.structured_outputs.params import (
    GrammarCompileError,
    GuidedDecodingParams,
    check_backend_name,
    field_name,
)

Defaults = StructuredOutputsConfig | str


def engine_defaults(defaults: Defaults) -> StructuredOutputsConfig:
    """The engine's structured-outputs config; a string is a backend name, with vLLM's option suffix
    allowed ("xgrammar:disable-any-whitespace"). ValueError for an unusable name or option."""
    if isinstance(defaults, StructuredOutputsConfig):
        return defaults
    bare, options = split_backend_options(defaults)
    return StructuredOutputsConfig(backend=check_backend_name(bare), **options)


def _resolved(params: GuidedDecodingParams, defaults: Defaults) -> tuple[GuidedDecodingParams, str]:
    """(the spec with every option applied, the backend that compiles it); ValueError as above."""
    config = engine_defaults(defaults)
    check_backend_name(params.backend or config.backend)  # an unknown suffix option names itself here
    params = params.resolved(config)
    name = check_backend_name(params.backend or config.backend)
    if name != "auto":
        return params, name
    if params.whitespace_pattern and not params.disable_fallback and importlib.util.find_spec("llguidance"):
        return params, "guidance"
    return params, "xgrammar"


def resolve_backend(params: GuidedDecodingParams, default_backend: Defaults = "auto") -> str:
    """"xgrammar" or "guidance" for a validated spec; ValueError for an unusable backend name."""
    return _resolved(params, default_backend)[1]


def check_spec(params: GuidedDecodingParams, default_backend: Defaults = "auto") -> None:
    """Intake check without a tokenizer (cheap; run it in a worker thread): raises
    GrammarCompileError(field, message) for a spec the chosen backend cannot compile."""
    try:
        params, backend = _resolved(params, default_backend)
    except ValueError as e:
        raise GrammarCompileError(field_name("backend"), str(e)) from None
    if backend == "guidance":
        import llguidance

        from aserve.structured_outputs.guidance import grammar_spec

        error = llguidance.LLMatcher.validate_grammar(grammar_spec(params))
        if error:
            raise GrammarCompileError(field_name(params.kind), f"cannot compile: {error.strip()}")
    else:
        from aserve.structured_outputs.backend import check_compiles

        check_compiles(params)


class SpecChecker:
    """`check_spec` with its verdicts cached by (backend, spec): request intake's compile check.

    Thread-safe; call it from a worker thread (the first call imports the grammar backend, and
    with it torch). Failures are cached too, so a client repeating a bad spec costs nothing.
    """

    def __init__(self, default_backend: Defaults = "auto", max_entries: int = 1024):
        self.defaults = engine_defaults(default_backend)
        self._verdicts = SpecCache(max_entries)

    def check(self, params: GuidedDecodingParams) -> None:
        """Raises GrammarCompileError(field, message) if the validated spec does not compile."""
        try:
            key_params = params.resolved(self.defaults)
        except ValueError as e:
            raise GrammarCompileError(field_name("backend"), str(e)) from None
        backend = key_params.backend or self.defaults.backend
        key = (backend, key_params.disable_fallback, key_params.spec_key())

        def verdict() -> GrammarCompileError | None:
            try:
                check_spec(params, self.defaults)
            except GrammarCompileError as e:
                return e
            return None

        error = self._verdicts.get_or_compile(key, verdict)
        if error is not None:
            raise GrammarCompileError(error.field, error.message)


class StructuredOutputCompilers:
    """Compilers for one tokenizer and model vocabulary, one per backend, built on first use.

    `compile(params)` returns the backend's cached grammar; `state_for(params, output_token_ids)`
    returns a fresh per-request state (xgrammar `GrammarState` or guidance `GuidanceState`, same
    contract) advanced past `output_token_ids`. Both raise GrammarCompileError naming the field;
    `state_for` raises GrammarStateError when the outputs do not fit the grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Sequence[int] | None = None,
                 default_backend: Defaults = "auto", max_cached: int = 256):
        self.defaults = engine_defaults(default_backend)
        self.default_backend = self.defaults.backend
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self._max_cached = max_cached
        self._compilers: dict[str, Any] = {}

    def compiler(self, backend: str) -> Any:
        """The compiler for "xgrammar" or "guidance" (built on first use)."""
        compiler = self._compilers.get(backend)
        if compiler is None:
            if backend == "guidance":
                from aserve.structured_outputs.guidance import GuidanceCompiler as cls
            else:
                from aserve.structured_outputs.backend import GrammarCompiler as cls
            compiler = self._compilers[backend] = cls(self._tokenizer, self.vocab_size,
                                                      stop_token_ids=self._stop_token_ids,
                                                      max_cached=self._max_cached)
        return compiler

    def _compiler_for(self, params: GuidedDecodingParams) -> tuple[Any, GuidedDecodingParams]:
        """(the compiler, the spec with every option applied)."""
        try:
            params, backend = _resolved(params, self.defaults)
            return self.compiler(backend), params
        except ValueError as e:
            if isinstance(e, GrammarCompileError):
                raise
            raise GrammarCompileError(field_name("backend"), str(e)) from None

    def compile(self, params: GuidedDecodingParams) -> Any:
        compiler, params = self._compiler_for(params)
        return compiler.compile(params)

    def state_for(self, params: GuidedDecodingParams, output_token_ids: Sequence[int] = (),
                  stop_token_ids: Sequence[int] | None = None) -> Any:
        """`stop_token_ids`: what this request's completed grammar allows (None: the compilers')."""
        compiler, params = self._compiler_for(params)
        return compiler.state_for(params, output_token_ids, stop_token_ids)
