"""Multi-step decode end to end with a real tokenizer: stop strings (which the engine finds in the
text after the call, with tokens past them computed and dropped) and a JSON-schema grammar (advanced
token by token inside the call) give exactly single-step decoding's text, tokens and logprobs."""

from __future__ import annotations

import pytest

from aserve import LLM, SamplingParams
from tests.e2e.test_spec_decode import (  # noqa: F401 (a fixture)
    TEXT_PROMPTS,
    assert_same_outputs,
    json_schema_params,
    tiny_llama_with_tokenizer,
)


def _llm(path: str, num_steps: int) -> LLM:
    return LLM(path, dtype="float32", max_model_len=256, cpu_kvcache_space=0.05, num_scheduler_steps=num_steps)


@pytest.fixture(scope="module")
def pair(tiny_llama_with_tokenizer):  # noqa: F811
    return _llm(tiny_llama_with_tokenizer, 1), _llm(tiny_llama_with_tokenizer, 5)


def test_stop_strings_cut_the_text_where_single_step_does(pair):
    single, multi = pair
    plain = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free = [o.outputs[0].text for o in single.generate(TEXT_PROMPTS, plain, use_tqdm=False)]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[t[len(t) // 2:len(t) // 2 + 3]],
                             logprobs=1) for t in free]
    want = single.generate(TEXT_PROMPTS, params, use_tqdm=False)
    got = multi.generate(TEXT_PROMPTS, params, use_tqdm=False)
    for w, g, p in zip(want, got, params):
        assert g.outputs[0].text == w.outputs[0].text and p.stop[0] not in g.outputs[0].text
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        assert g.outputs[0].finish_reason == "stop" and g.outputs[0].stop_reason == p.stop[0]


def test_json_schema_grammar_advances_inside_the_call(pair):
    pytest.importorskip("xgrammar")
    single, multi = pair
    params = json_schema_params()
    prompts = ["JSON: {\"name\": \"ab\", \"tags\": [\"a\", \"b\"]} JSON:", TEXT_PROMPTS[1]]
    assert_same_outputs(single, multi, prompts, params)
