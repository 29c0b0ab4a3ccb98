"""Engine-wide structured-outputs options through the offline API on the bundled SmolLM2 (greedy):
`--guided-decoding-backend xgrammar:disable-any-whitespace` and `--structured-outputs-config`'s
`disable_any_whitespace` / `disable_additional_properties` change what the model writes for a request
that asks for nothing special (before, the suffix and the keys were accepted and dropped)."""

from __future__ import annotations

import json

import pytest

from aserve import GuidedDecodingParams, SamplingParams

pytestmark = pytest.mark.slow

NAME_ONLY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
ASK = [{"role": "user", "content": "Give a person as JSON with the keys name, age and city."}]


def _json_text(llm) -> str:
    params = SamplingParams(max_tokens=48, temperature=0, guided_decoding=GuidedDecodingParams(json=NAME_ONLY))
    (out,) = llm.chat([ASK], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    return out.outputs[0].text


@pytest.fixture(scope="module")
def make_llm(bundled_model_path):
    from aserve import LLM

    made = []

    def make(**kwargs):
        llm = LLM(dtype="float32", max_model_len=256, cpu_kvcache_space=0.05, max_num_seqs=4, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.shutdown()


def test_guidance_options_from_structured_outputs_config(make_llm):
    pytest.importorskip("llguidance")
    plain = _json_text(make_llm(guided_decoding_backend="guidance"))
    assert "\n" in plain and {"age", "city"} <= json.loads(plain).keys()  # what the model does unasked
    text = _json_text(make_llm(structured_outputs_config={
        "backend": "guidance", "disable_any_whitespace": True, "disable_additional_properties": True}))
    assert json.loads(text).keys() == {"name"}
    assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)


def test_xgrammar_disable_any_whitespace_suffix(make_llm):
    plain = _json_text(make_llm())
    assert "\n" in plain
    text = _json_text(make_llm(guided_decoding_backend="xgrammar:disable-any-whitespace"))
    assert text == json.dumps(json.loads(text), ensure_ascii=False)  # xgrammar's canonical `{"k": v}`
