"""GuidedDecodingParams: exactly one kind, shape checks naming the field, spec keys, backend names."""

from __future__ import annotations

import pytest

from aserve.sampling_params import SamplingParamsError
from aserve.structured_outputs.params import (
    GuidedDecodingParams,
    StructuredOutputsParams,
    check_backend_name,
)


def _field_of(params: GuidedDecodingParams) -> str:
    with pytest.raises(SamplingParamsError) as info:
        params.validate()
    return info.value.field


def test_alias_is_the_same_type():
    assert StructuredOutputsParams is GuidedDecodingParams


@pytest.mark.parametrize("params", [
    GuidedDecodingParams(json={"type": "object"}),
    GuidedDecodingParams(json='{"type": "string"}'),
    GuidedDecodingParams(regex=r"\d+"),
    GuidedDecodingParams(choice=["a", "b"]),
    GuidedDecodingParams(grammar='root ::= "x"'),
    GuidedDecodingParams(json_object=True),
    GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {"type": "const_string",
                                                                              "value": "hi"}}),
])
def test_one_kind_validates(params):
    params.validate()
    assert len(params.kinds_given()) == 1


def test_no_kind_and_two_kinds_are_errors():
    assert _field_of(GuidedDecodingParams()) == "guided_decoding"
    assert _field_of(GuidedDecodingParams(json_object=False)) == "guided_decoding"
    assert _field_of(GuidedDecodingParams(regex="a", choice=["a"])) == "guided_choice"


@pytest.mark.parametrize("params, field", [
    (GuidedDecodingParams(json="{not json"), "guided_json"),
    (GuidedDecodingParams(json="[1, 2]"), "guided_json"),
    (GuidedDecodingParams(choice=[]), "guided_choice"),
    (GuidedDecodingParams(choice=["a", ""]), "guided_choice"),
    (GuidedDecodingParams(regex=""), "guided_regex"),
    (GuidedDecodingParams(grammar=""), "guided_grammar"),
    (GuidedDecodingParams(structural_tag="{oops"), "structural_tag"),
    (GuidedDecodingParams(regex="a", whitespace_pattern=" "), "guided_whitespace_pattern"),
    (GuidedDecodingParams(regex="a", backend="outlines"), "guided_decoding_backend"),
])
def test_malformed_specs_name_their_field(params, field):
    assert _field_of(params) == field


def test_spec_key_canonicalises_json_schemas():
    as_dict = GuidedDecodingParams(json={"b": 1, "type": "object"})
    as_text = GuidedDecodingParams(json='{"type": "object",  "b": 1}')
    assert as_dict.spec_key() == as_text.spec_key()
    assert as_dict.spec_key() != GuidedDecodingParams(json={"type": "object"}).spec_key()
    compact = GuidedDecodingParams(json={"b": 1, "type": "object"}, disable_any_whitespace=True)
    assert compact.spec_key() != as_dict.spec_key()
    assert (GuidedDecodingParams(regex="a", backend="xgrammar").spec_key()
            == GuidedDecodingParams(regex="a").spec_key())


def test_pydantic_model_becomes_its_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    params = GuidedDecodingParams(json=Point)
    assert params.json["properties"].keys() == {"x", "y"}


def test_msgspec_round_trip():
    import msgspec

    params = GuidedDecodingParams(choice=["a", "b"], backend="xgrammar")
    data = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(data, type=GuidedDecodingParams) == params


@pytest.mark.parametrize("name, expected", [("auto", "auto"), ("XGrammar", "xgrammar"),
                                            ("xgrammar:no-fallback", "xgrammar"), ("guidance", "guidance")])
def test_backend_names_accepted(name, expected):
    if expected == "guidance":
        pytest.importorskip("llguidance")
    assert check_backend_name(name) == expected


@pytest.mark.parametrize("name, words", [("outlines", "not supported"),
                                         ("lm-format-enforcer", "not supported"),
                                         ("magic", "unknown")])
def test_backend_names_refused_with_a_clear_message(name, words):
    with pytest.raises(ValueError, match=words):
        check_backend_name(name)


def test_light_modules_stay_light():
    """sampling_params and intake will import these modules: they must not pull torch or xgrammar."""
    import subprocess
    import sys

    code = ("import sys, aserve.structured_outputs.params, aserve.structured_outputs.registry; "
            "bad = [m for m in ('torch', 'xgrammar', 'llguidance') if m in sys.modules]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
