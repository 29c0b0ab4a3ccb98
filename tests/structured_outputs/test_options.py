"""The engine-wide structured-outputs options (vLLM's `backend:option` suffixes and
--structured-outputs-config keys) change what the compiled grammars accept, on SmolLM2's tokenizer:
compact JSON, closed objects, no fallback to guidance; a request's own suffix works the same way."""

from __future__ import annotations

import pytest

from aserve.config import StructuredOutputsConfig
from aserve.structured_outputs.params import GrammarCompileError, GuidedDecodingParams
from aserve.structured_outputs.registry import SpecChecker, StructuredOutputCompilers, resolve_backend

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def make_compilers(smol_tokenizer, model_vocab_size, eos_token_id):
    def make(defaults) -> StructuredOutputCompilers:
        return StructuredOutputCompilers(smol_tokenizer, model_vocab_size, stop_token_ids=[eos_token_id],
                                         default_backend=defaults)

    return make


def _accepts(compilers, params, text, tokenizer) -> bool:
    """Whether the grammar takes `text` (then a stop token) from the start."""
    state = compilers.state_for(params)
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return all(state.accept_token(t) for t in ids)


def test_disable_additional_properties_closes_guidance_objects(make_compilers, smol_tokenizer):
    pytest.importorskip("llguidance")
    extra = '{"a": 1, "b": 2}'
    spec = GuidedDecodingParams(json=OPEN)
    assert _accepts(make_compilers("guidance"), spec, extra, smol_tokenizer)  # guidance follows JSON Schema
    for defaults in ("guidance:disable-additional-properties",
                     StructuredOutputsConfig("guidance", disable_additional_properties=True)):
        compilers = make_compilers(defaults)
        assert not _accepts(compilers, spec, extra, smol_tokenizer)
        assert _accepts(compilers, spec, '{"a": 1}', smol_tokenizer)
    # a schema that allows more keeps its word; nested objects are closed too
    compilers = make_compilers("guidance:disable-additional-properties")
    allowing = GuidedDecodingParams(json={**OPEN, "additionalProperties": {"type": "integer"}})
    assert _accepts(compilers, allowing, extra, smol_tokenizer)
    nested = GuidedDecodingParams(json={"type": "object", "properties": {"o": OPEN}})
    assert not _accepts(compilers, nested, '{"o": {"a": 1, "b": 2}}', smol_tokenizer)
    assert _accepts(make_compilers("guidance"), nested, '{"o": {"a": 1, "b": 2}}', smol_tokenizer)
    # the request's own suffix turns it on too
    own = GuidedDecodingParams(json=OPEN, backend="guidance:disable-additional-properties")
    assert not _accepts(make_compilers("auto"), own, extra, smol_tokenizer)


def test_xgrammar_objects_are_closed_either_way(make_compilers, smol_tokenizer):
    for defaults in ("xgrammar", "xgrammar:disable-additional-properties"):
        assert not _accepts(make_compilers(defaults), GuidedDecodingParams(json=OPEN), '{"a": 1, "b": 2}',
                            smol_tokenizer)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_disable_any_whitespace_is_the_engine_default(backend, make_compilers, smol_tokenizer):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    pretty = '{\n  "a": 1\n}'
    spec = GuidedDecodingParams(json=OPEN)
    assert _accepts(make_compilers(backend), spec, pretty, smol_tokenizer)
    compact = make_compilers(f"{backend}:disable-any-whitespace")
    assert not _accepts(compact, spec, pretty, smol_tokenizer)
    assert not _accepts(compact, GuidedDecodingParams(json_object=True), '{ "a" : 1 }', smol_tokenizer)
    # xgrammar's whitespace-free JSON is its canonical `{"a": 1}`; guidance's is `{"a":1}`
    assert _accepts(compact, spec, '{"a": 1}' if backend == "xgrammar" else '{"a":1}', smol_tokenizer)
    # a request's own whitespace pattern wins over the engine's default (guidance serves any pattern)
    if backend == "guidance":
        patterned = GuidedDecodingParams(json=OPEN, whitespace_pattern=r"[ ]?")
        assert _accepts(compact, patterned, '{ "a": 1 }', smol_tokenizer)


def test_no_fallback_keeps_auto_on_xgrammar():
    pytest.importorskip("llguidance")
    patterned = GuidedDecodingParams(json=OPEN, whitespace_pattern=" ?")
    assert resolve_backend(patterned, "auto") == "guidance"  # what only guidance serves
    assert resolve_backend(patterned, "auto:no-fallback") == "xgrammar"
    assert resolve_backend(patterned, StructuredOutputsConfig(disable_fallback=True)) == "xgrammar"
    own = GuidedDecodingParams(json=OPEN, whitespace_pattern=" ?", disable_fallback=True)
    assert resolve_backend(own, "auto") == "xgrammar"
    # without the fallback, what xgrammar cannot serve is refused at intake, naming the field
    SpecChecker("auto").check(patterned)
    with pytest.raises(GrammarCompileError) as err:
        SpecChecker(StructuredOutputsConfig(disable_fallback=True)).check(patterned)
    assert err.value.field == "guided_whitespace_pattern"


def test_unknown_request_option_names_the_field_and_the_option():
    params = GuidedDecodingParams(regex="a", backend="xgrammar:turbo")
    with pytest.raises(GrammarCompileError) as err:
        SpecChecker("auto").check(params)
    assert err.value.field == "guided_decoding_backend" and "turbo" in err.value.message
    from aserve.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as err:
        params.validate()
    assert err.value.field == "guided_decoding_backend"
