"""SamplingParams validation: every invalid value raises an error naming its field; each cap holds
at the cap and fails one past it."""

from __future__ import annotations

import math

import pytest

from aserve.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SamplingParams,
    SamplingParamsError,
)

FLOAT_FIELDS = ["presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"]
INT_FIELDS = ["n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
              "truncate_prompt_tokens"]


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(min_p=2), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop=[1]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(logit_bias={1: 200}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={"-3": 1}), "logit_bias"),
    (dict(logit_bias={"1" * 30: 1}), "logit_bias"), (dict(logit_bias={"١": 1}), "logit_bias"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(n=True), "n"), (dict(seed=1.5), "seed"),
    (dict(temperature="1"), "temperature"), (dict(stop="x", detokenize=False), "stop"),
    (dict(logits_processors=[1]), "logits_processors"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400], ids=["nan", "inf", "-inf", "10^400"])
def test_floats_must_be_finite(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [2**64, 10**5000, -(10**5000)], ids=["2^64", "10^5000", "-10^5000"])
def test_integers_beyond_64_bits_are_refused(field, value):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert len(str(info.value)) < 200  # a huge integer is described, not printed


def test_seed_takes_the_int64_range():
    assert SamplingParams(seed=INT64_MIN).seed == INT64_MIN
    assert SamplingParams(seed=INT64_MAX).seed == INT64_MAX
    for seed in (INT64_MIN - 1, INT64_MAX + 1):
        with pytest.raises(SamplingParamsError, match="seed"):
            SamplingParams(seed=seed)


def test_range_edges_are_accepted():
    SamplingParams(temperature=0.0, presence_penalty=-2.0, frequency_penalty=2.0, top_p=1.0, min_p=1.0)
    SamplingParams(temperature=MAX_TEMPERATURE, repetition_penalty=MAX_REPETITION_PENALTY, top_k=INT64_MAX)
    SamplingParams(logit_bias={"7": -100, 8: 100.0}, max_tokens=INT64_MAX, min_tokens=INT64_MAX)
    with pytest.raises(SamplingParamsError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=MAX_REPETITION_PENALTY * 1.01)
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams(temperature=MAX_TEMPERATURE * 1.01)


@pytest.mark.parametrize("field, at_cap, past_cap", [
    ("n", dict(n=MAX_N), dict(n=MAX_N + 1)),
    ("best_of", dict(best_of=MAX_N), dict(best_of=MAX_N + 1)),
    ("stop", dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
     dict(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])),
    ("stop", dict(stop=["x" * MAX_STOP_STRING_CHARS]), dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])),
    ("stop_token_ids", dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
     dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))),
    ("logit_bias", dict(logit_bias={str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}),
     dict(logit_bias={str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})),
])
def test_caps_hold_at_the_cap_and_fail_past_it(field, at_cap, past_cap):
    SamplingParams(**at_cap)
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**past_cap)
    assert info.value.field == field


def test_normalisation():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(logit_bias={"5": 1, 6: -2}).logit_bias == {5: 1.0, 6: -2.0}
    greedy = SamplingParams(temperature=0, top_p=0.5, top_k=3)
    assert greedy.sampling_type_greedy and greedy.top_p == 1.0 and greedy.top_k == -1
    assert SamplingParams(n=2, best_of=4).num_samples == 4
