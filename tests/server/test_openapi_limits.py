"""/openapi.json shows each limited request field's range and meaning, taken from the one table the
validation uses (`aserve.sampling_params.LIMITS`), and a value just outside a documented range is
still a 400 in OpenAI's format naming the field (real engine over a fake model)."""

from __future__ import annotations

from typing import Any

import pytest

from aserve.sampling_params import (
    INT64_MAX,
    LIMITS,
    MAX_N,
    MAX_TEMPERATURE,
    SamplingParams,
    SamplingParamsError,
)
from tests.server.server_harness import CHAT, COMPLETIONS, USER, error_body

pytestmark = pytest.mark.timeout(60)

# request field -> the LIMITS entry it documents, per request body
CHAT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "n": "n",
    "seed": "seed",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "logit_bias": "logit_bias",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
    "priority": "priority",
}
COMPLETION_FIELDS = {
    **{k: v for k, v in CHAT_FIELDS.items() if k not in ("max_completion_tokens", "top_logprobs")},
    "best_of": "best_of",
    "logprobs": "logprobs",
    "prompt_logprobs": "prompt_logprobs",
    "prompt": "prompts",
}


@pytest.fixture(scope="module")
def doc(http) -> dict[str, Any]:
    r = http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def _props(doc: dict[str, Any], name: str) -> dict[str, Any]:
    return doc["components"]["schemas"][name]["properties"]


@pytest.mark.parametrize(
    "schema_name, fields", [("ChatCompletionRequest", CHAT_FIELDS), ("CompletionRequest", COMPLETION_FIELDS)]
)
def test_document_carries_each_fields_range_and_description(doc, schema_name, fields):
    props = _props(doc, schema_name)
    for field, key in fields.items():
        prop, limit = props[field], LIMITS[key]
        assert prop.get("description"), (schema_name, field)
        for keyword, value in limit.json_schema().items():
            assert prop[keyword] == value, (schema_name, field, keyword)
    # chat's logprobs is a flag: described, but no numeric range
    assert _props(doc, "ChatCompletionRequest")["logprobs"]["description"]
    assert "minimum" not in _props(doc, "ChatCompletionRequest")["logprobs"]


def test_the_ranges_in_the_document_are_the_enforced_ones(doc):
    chat = _props(doc, "ChatCompletionRequest")
    assert (
        (chat["temperature"]["minimum"], chat["temperature"]["maximum"])
        == (0.0, MAX_TEMPERATURE)
        == (0.0, 100.0)
    )
    assert (chat["top_p"]["exclusiveMinimum"], chat["top_p"]["maximum"]) == (0.0, 1.0)
    assert (chat["min_p"]["minimum"], chat["min_p"]["maximum"]) == (0.0, 1.0)
    assert (chat["top_k"]["minimum"], chat["top_k"]["maximum"]) == (-1, INT64_MAX)
    assert (chat["presence_penalty"]["minimum"], chat["presence_penalty"]["maximum"]) == (-2.0, 2.0)
    assert (chat["n"]["minimum"], chat["n"]["maximum"]) == (1, MAX_N)
    assert chat["logit_bias"]["maxProperties"] == 1024
    assert chat["logit_bias"]["additionalProperties"] == {"minimum": -100.0, "maximum": 100.0}
    assert (chat["seed"]["minimum"], chat["seed"]["maximum"]) == (-(2**63), 2**63 - 1)
    assert _props(doc, "CompletionRequest")["prompt"]["maxItems"] == 256
    # each documented bound is what SamplingParams accepts, and one step past it is refused
    for key, limit in LIMITS.items():
        if limit.low is None or not hasattr(SamplingParams, key):
            continue
        step = 1 if isinstance(limit.low, int) else 1e-3
        extra = {"max_tokens": None} if key == "min_tokens" else {}  # min_tokens <= max_tokens
        SamplingParams(**{key: limit.high}, **extra)
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(**{key: limit.high + step}, **extra)
        assert err.value.field == key
        if not limit.open_low:
            SamplingParams(**{key: limit.low}, **extra)
        if limit.low > -(2**63):
            with pytest.raises(SamplingParamsError) as err:
                SamplingParams(**{key: limit.low if limit.open_low else limit.low - step}, **extra)
            assert err.value.field == key


def _past(doc: dict[str, Any], schema: str, field: str) -> Any:
    """A value just above the documented maximum of `field` (read from the document)."""
    high = _props(doc, schema)[field]["maximum"]
    return high + 1 if isinstance(high, int) else high + 0.5


@pytest.mark.parametrize(
    "path, schema, field",
    [
        (CHAT, "ChatCompletionRequest", f)
        for f in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "n",
        )
    ]
    + [(COMPLETIONS, "CompletionRequest", f) for f in ("temperature", "n", "best_of", "seed", "top_k")],
)
def test_a_value_past_the_documented_maximum_is_a_400_naming_the_field(http, doc, path, schema, field):
    body: dict[str, Any] = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    body[field] = _past(doc, schema, field)
    err = error_body(http.post(path, json=body, timeout=30), 400, field)
    assert err["type"] == "invalid_request_error"
    assert field in err["message"] or "must be" in err["message"]


def test_values_below_the_documented_minimum_and_oversized_maps_are_400s(http, doc):
    chat = _props(doc, "ChatCompletionRequest")
    error_body(
        http.post(CHAT, json={"messages": USER, "temperature": chat["temperature"]["minimum"] - 1}),
        400,
        "temperature",
    )
    error_body(
        http.post(CHAT, json={"messages": USER, "top_p": chat["top_p"]["exclusiveMinimum"]}), 400, "top_p"
    )
    error_body(http.post(CHAT, json={"messages": USER, "n": chat["n"]["minimum"] - 1}), 400, "n")
    bias = {str(i): 1 for i in range(chat["logit_bias"]["maxProperties"] + 1)}
    error_body(http.post(CHAT, json={"messages": USER, "logit_bias": bias}), 400, "logit_bias")
    too_big = chat["logit_bias"]["additionalProperties"]["maximum"] + 1
    error_body(http.post(CHAT, json={"messages": USER, "logit_bias": {"1": too_big}}), 400, "logit_bias")
