"""SamplingParams validation: every invalid value raises an error naming its field."""

from __future__ import annotations

import pytest

from aserve.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(logit_bias={1: 200}), "logit_bias"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and field in str(info.value)


def test_model_dependent_checks():
    with pytest.raises(SamplingParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).validate_for_model(vocab_size=50, max_logprobs=5)
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=6).validate_for_model(vocab_size=50, max_logprobs=5)
    SamplingParams(logprobs=5, stop_token_ids=[49]).validate_for_model(vocab_size=50, max_logprobs=5)


def test_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=0).top_k == -1
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert greedy.sampling_type_greedy and greedy.top_p == 1.0 and greedy.top_k == -1
    assert SamplingParams(n=2, best_of=4).num_samples == 4
