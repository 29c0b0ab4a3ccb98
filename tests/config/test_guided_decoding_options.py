"""--guided-decoding-backend's vLLM option suffixes and --structured-outputs-config's option keys become
StructuredOutputsConfig fields (never dropped); unknown options, keys and contradictions are refused
naming them."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs, StructuredOutputsConfig
from aserve.config.guided_decoding import split_backend_options


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), StructuredOutputsConfig()),
    (dict(guided_decoding_backend="xgrammar:disable-any-whitespace"),
     StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)),
    (dict(guided_decoding_backend="xgrammar:no-fallback"), StructuredOutputsConfig("xgrammar", disable_fallback=True)),
    (dict(guided_decoding_backend="auto:no-fallback,disable-any-whitespace"),
     StructuredOutputsConfig("auto", disable_any_whitespace=True, disable_fallback=True)),
    (dict(guided_decoding_backend="guidance:disable-additional-properties"),
     StructuredOutputsConfig("guidance", disable_additional_properties=True)),
    (dict(guided_decoding_backend="guidance:no-additional-properties"),  # vLLM's older spelling
     StructuredOutputsConfig("guidance", disable_additional_properties=True)),
    (dict(structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True,
                                     "disable_additional_properties": True, "disable_fallback": True}),
     StructuredOutputsConfig("xgrammar", True, True, True)),
    (dict(structured_outputs_config={"disable_any_whitespace": True}),
     StructuredOutputsConfig("auto", disable_any_whitespace=True)),
    # the suffix's options and the keys add up; the config's backend wins
    (dict(guided_decoding_backend="xgrammar:no-fallback",
          structured_outputs_config={"backend": "guidance", "disable_any_whitespace": True}),
     StructuredOutputsConfig("guidance", disable_any_whitespace=True, disable_fallback=True)),
    (dict(structured_outputs_config={"backend": "auto", "reasoning_parser": "deepseek_r1"}), StructuredOutputsConfig()),
])
def test_options_reach_the_config(kwargs, expected, tmp_path):
    pytest.importorskip("llguidance")
    args = EngineArgs(**kwargs)
    assert args.resolved_structured_outputs() == expected
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"max_position_embeddings": 512, "torch_dtype": "float32", "eos_token_id": 2}')
    assert args.create_config(str(tmp_path)).structured_outputs == expected


@pytest.mark.parametrize("kwargs, words", [
    (dict(guided_decoding_backend="xgrammar:disable-any-whitespaces"),
     ["--guided-decoding-backend", "disable-any-whitespaces"]),
    (dict(guided_decoding_backend="xgrammar:no-fallback,strict"), ["--guided-decoding-backend", "'strict'"]),
    (dict(guided_decoding_backend="outlines:no-fallback"), ["--guided-decoding-backend", "outlines"]),
    (dict(structured_outputs_config={"backend": "xgrammar:bogus"}), ["--structured-outputs-config", "bogus"]),
    (dict(structured_outputs_config={"disable_any_whitespace": "yes"}),
     ["--structured-outputs-config", "disable_any_whitespace must be true or false"]),
    (dict(structured_outputs_config={"enable_in_reasoning": True}),
     ["--structured-outputs-config", "enable_in_reasoning"]),
    (dict(structured_outputs_config={"reasoning_parser": 3}), ["--structured-outputs-config", "reasoning_parser"]),
    (dict(guided_decoding_backend="xgrammar:disable-any-whitespace",
          structured_outputs_config={"disable_any_whitespace": False}),
     ["--structured-outputs-config", "contradicts"]),
])
def test_bad_options_are_refused_naming_them(kwargs, words):
    with pytest.raises(ConfigError) as err:
        EngineArgs(**kwargs).validate()
    for word in words:
        assert word in str(err.value)


def test_split_backend_options():
    assert split_backend_options(" XGrammar : Disable-Any-Whitespace , no-fallback ") == (
        "xgrammar", {"disable_any_whitespace": True, "disable_fallback": True})
    assert split_backend_options("auto") == ("auto", {})
    with pytest.raises(ValueError, match="'fast'"):
        split_backend_options("guidance:fast")
