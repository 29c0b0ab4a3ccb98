"""Compiled grammars drive a batched sampling loop on SmolLM2's tokenizer: outputs are valid."""

from __future__ import annotations

import json
import re
import threading

import pytest

from aserve.structured_outputs.backend import choice_grammar
from aserve.structured_outputs.cache import SpecCache
from aserve.structured_outputs.params import GrammarCompileError, GuidedDecodingParams
from aserve.structured_outputs.registry import check_spec, resolve_backend

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested_required_optional": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"id": {"type": "integer", "minimum": 0},
                                    "nick": {"type": "string", "maxLength": 12}},
                     "required": ["id"]},
            "active": {"type": "boolean"},
        },
        "required": ["user"],
    },
    "enums_and_bounded_arrays": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        },
        "required": ["color", "sizes", "tags"],
    },
    "string_patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "score": {"type": "number"},
        },
        "required": ["code", "email"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5},
                                                   "v": {"type": ["integer", "null"]}},
                  "required": ["k", "v"]},
        "minItems": 1, "maxItems": 3,
    },
}


def _all_finished(outputs):
    assert all(o.terminated for o in outputs), [o.text for o in outputs if not o.terminated]


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("compact", [True, False])
def test_json_schema_outputs_validate(sample, name, compact):
    schema = SCHEMAS[name]
    outputs = sample(GuidedDecodingParams(json=schema, disable_any_whitespace=compact), seed=len(name))
    _all_finished(outputs)
    for out in outputs:
        jsonschema.validate(json.loads(out.text), schema)
        if compact:
            assert "\n" not in out.text


def test_json_object_is_an_object(sample):
    outputs = sample(GuidedDecodingParams(json_object=True, disable_any_whitespace=True), seed=3)
    _all_finished(outputs)
    assert all(isinstance(json.loads(o.text), dict) for o in outputs)


@pytest.mark.parametrize("pattern", [r"[a-z]{3}-\d{2,4}", r"(yes|no)!?", r"\d{4}-\d{2}-\d{2}T[0-2]\d:\d\d"])
def test_regex_outputs_match(sample, pattern):
    outputs = sample(GuidedDecodingParams(regex=pattern), seed=7)
    _all_finished(outputs)
    assert all(re.fullmatch(pattern, o.text) for o in outputs), [o.text for o in outputs]


def test_choice_outputs_are_choices(sample):
    choices = ["positive", "negative", 'say "maybe"', "back\\slash", "naïve ☃"]
    outputs = sample(GuidedDecodingParams(choice=choices), n=12, seed=11)
    _all_finished(outputs)
    assert all(o.text in choices for o in outputs)
    assert len({o.text for o in outputs}) > 1  # the random logits pick different choices


def test_choice_grammar_escapes_literals():
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""


def _parse_arithmetic(text: str) -> None:
    """A recursive-descent parser for ARITHMETIC; raises ValueError when `text` is not a sentence."""
    pos = 0

    def expr():
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    def term():
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            expr()
            if pos >= len(text) or text[pos] != ")":
                raise ValueError(f"expected ')' at {pos} in {text!r}")
            pos += 1
        else:
            m = re.compile(r"[1-9][0-9]?").match(text, pos)
            if not m:
                raise ValueError(f"expected a number at {pos} in {text!r}")
            pos = m.end()

    expr()
    if pos != len(text):
        raise ValueError(f"trailing text at {pos} in {text!r}")


def test_ebnf_grammar_outputs_parse(sample):
    outputs = sample(GuidedDecodingParams(grammar=ARITHMETIC), seed=5)
    _all_finished(outputs)
    for out in outputs:
        _parse_arithmetic(out.text)


def test_structural_tag_compiles_and_constrains(compiler, sample):
    if compiler.name == "guidance":
        pytest.skip("structural_tag is served by xgrammar only")
    tag = {"type": "structural_tag",
           "format": {"type": "sequence", "elements": [
               {"type": "const_string", "value": "<answer>"},
               {"type": "json_schema", "json_schema": {"type": "object",
                                                       "properties": {"n": {"type": "integer"}},
                                                       "required": ["n"]}},
               {"type": "const_string", "value": "</answer>"}]}}
    outputs = sample(GuidedDecodingParams(structural_tag=tag), n=3, seed=2)
    _all_finished(outputs)
    for out in outputs:
        m = re.fullmatch(r"<answer>(.*)</answer>", out.text, re.DOTALL)
        assert m and isinstance(json.loads(m.group(1))["n"], int), out.text


UNCOMPILABLE = [
    (GuidedDecodingParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "guided_json"),
    (GuidedDecodingParams(json={"type": 12}), "guided_json"),
    (GuidedDecodingParams(regex="(unclosed"), "guided_regex"),
    (GuidedDecodingParams(grammar="root ::= undefined_rule"), "guided_grammar"),
    (GuidedDecodingParams(structural_tag='{"no": "format"}'), "structural_tag"),
    (GuidedDecodingParams(json={"type": "object"}, whitespace_pattern=r"[ ]?"), "guided_whitespace_pattern"),
]


XGRAMMAR_ONLY_ERRORS = {"guided_whitespace_pattern"}  # guidance supports any whitespace pattern


@pytest.mark.parametrize("params, field", UNCOMPILABLE)
def test_uncompilable_spec_names_the_field(compiler, params, field):
    params.validate()  # well-formed: only compilation can tell
    if compiler.name == "guidance" and field in XGRAMMAR_ONLY_ERRORS:
        compiler.compile(params)
        return
    with pytest.raises(GrammarCompileError) as info:
        compiler.compile(params)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert "/project/cpp" not in str(info.value)  # xgrammar's source locations are stripped


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("params, field", UNCOMPILABLE)
def test_intake_check_agrees_with_the_compiler(backend, params, field):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    if backend == "guidance" and field in XGRAMMAR_ONLY_ERRORS:
        check_spec(params, backend)
        return
    with pytest.raises(GrammarCompileError) as info:
        check_spec(params, backend)
    assert info.value.field == field


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
@pytest.mark.parametrize("params", [GuidedDecodingParams(json=schema) for schema in SCHEMAS.values()] + [
    GuidedDecodingParams(regex=r"\d+"), GuidedDecodingParams(choice=['a"', "b"]),
    GuidedDecodingParams(grammar=ARITHMETIC), GuidedDecodingParams(json_object=True)])
def test_intake_check_passes_good_specs(backend, params):
    if backend == "guidance":
        pytest.importorskip("llguidance")
    check_spec(params, backend)


def test_auto_backend_routes_what_only_guidance_serves():
    pytest.importorskip("llguidance")
    assert resolve_backend(GuidedDecodingParams(regex="a")) == "xgrammar"
    assert resolve_backend(GuidedDecodingParams(json={}, whitespace_pattern=" ?")) == "guidance"
    assert resolve_backend(GuidedDecodingParams(json={}, whitespace_pattern=" ?"), "xgrammar") == "xgrammar"
    assert resolve_backend(GuidedDecodingParams(regex="a", backend="guidance"), "xgrammar") == "guidance"


def test_unusable_request_backend_is_a_field_error(compilers):
    with pytest.raises(GrammarCompileError) as info:
        compilers.compile(GuidedDecodingParams(regex="a", backend="outlines"))
    assert info.value.field == "guided_decoding_backend"


def test_cache_returns_the_same_compiled_object(compiler):
    a = compiler.compile(GuidedDecodingParams(json={"type": "object", "properties": {"q": {"type": "string"}}}))
    b = compiler.compile(GuidedDecodingParams(json='{"properties": {"q": {"type": "string"}}, "type": "object"}'))
    c = compiler.compile(GuidedDecodingParams(json={"type": "object", "properties": {"r": {"type": "string"}}}))
    assert a is b
    assert c is not a


def test_failures_are_not_cached(compiler):
    bad = GuidedDecodingParams(regex="(x")
    for _ in range(2):
        with pytest.raises(GrammarCompileError):
            compiler.compile(bad)


def test_lru_evicts_oldest():
    cache = SpecCache(max_entries=2)
    first = cache.get_or_compile("a", object)
    cache.get_or_compile("b", object)
    assert cache.get_or_compile("a", object) is first  # refreshed: "b" is now the oldest
    cache.get_or_compile("c", object)
    assert len(cache) == 2
    assert cache.get_or_compile("a", object) is first
    assert cache.get_or_compile("b", lambda: "recompiled") == "recompiled"


def test_concurrent_compiles_of_one_spec_share_the_result(compiler):
    params = GuidedDecodingParams(json={"type": "object", "properties": {"concurrent": {"type": "integer"}}})
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(params))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)


def test_tokens_past_the_tokenizer_are_never_allowed(compiler, smol_tokenizer):
    """The model's vocab may exceed the tokenizer's: those ids must stay masked."""
    import torch

    from aserve.structured_outputs.bitmask import BitmaskBuilder, apply_bitmask

    assert compiler.vocab_size >= len(smol_tokenizer)
    state = compiler.new_state(compiler.compile(GuidedDecodingParams(json_object=True)))
    logits = torch.zeros(1, compiler.vocab_size + 40)  # wider than the bitmask, too
    apply_bitmask(logits, BitmaskBuilder(compiler.vocab_size, 1).fill([0], [state]), [0])
    allowed = torch.isfinite(logits[0]).nonzero().flatten()
    assert allowed.numel() > 0 and int(allowed.max()) < len(smol_tokenizer)


def test_guidance_follows_a_whitespace_pattern(compiler, sample):
    if compiler.name != "guidance":
        pytest.skip("xgrammar supports only the empty whitespace pattern")
    schema = SCHEMAS["enums_and_bounded_arrays"]
    outputs = sample(GuidedDecodingParams(json=schema, whitespace_pattern=r"[ ]?"), n=4, seed=9)
    _all_finished(outputs)
    for out in outputs:
        jsonschema.validate(json.loads(out.text), schema)
        assert "\n" not in out.text and "  " not in out.text
