"""Every field of OpenAI's current chat-completions request is accepted by the real server (the openai SDK
sends them as typed arguments): `reasoning_effort` reaches the chat template, the ones that change
nothing here are accepted and ignored, those that cannot be honoured are refused by name
(`unsupported_parameter`), and a truly unknown field is still a 400 `unknown_field`."""

from __future__ import annotations

import openai
import pytest

from tests.server.server_harness import CHAT, MODEL, USER, error_body, last_added

pytestmark = pytest.mark.timeout(60)

SHOW_EFFORT = "effort={{ reasoning_effort | default('unset') }} {{ messages[0]['content'] }}"


def test_openai_fields_are_accepted_and_change_nothing_they_should_not(client, engine):
    plain = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=5)
    plain_prompt = last_added(engine)[0]
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, temperature=0, max_tokens=5,
        metadata={"team": "search"}, service_tier="auto", prompt_cache_key="user-42",
        safety_identifier="hash-of-user", store=True, verbosity="low", modalities=["text"],
        prediction={"type": "content", "content": "hello"}, stream_options=None,
        extra_body={"prompt_cache_retention": "24h"},
    )
    assert last_added(engine)[0] == plain_prompt  # nothing reached the prompt
    assert resp.choices[0].message.content == plain.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=3, stream=True, metadata={"a": "b"},
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert chunks[-1].usage is not None


def test_reasoning_effort_reaches_the_chat_template(client, engine, tokenizer):
    def prompt_for(**kwargs) -> str:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"chat_template": SHOW_EFFORT}, **kwargs)
        return tokenizer.decode(last_added(engine)[0])

    assert prompt_for() == "effort=unset hi"
    assert prompt_for(reasoning_effort="low") == "effort=low hi"
    extra = {"chat_template": SHOW_EFFORT, "chat_template_kwargs": {"reasoning_effort": "high"}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, reasoning_effort="low",
                                       extra_body=extra)
    assert err.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("field, value", [
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("web_search_options", {}),
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("function_call", "auto"),
])
def test_what_cannot_be_honoured_is_refused_by_name(http, field, value):
    r = http.post(CHAT, json={"model": MODEL, "messages": USER, field: value})
    assert error_body(r, 400, field)["code"] == "unsupported_parameter"


@pytest.mark.parametrize("body", [{"not_an_openai_field": 1}, {"reasoning_effort": "extreme"},
                                  {"service_tier": "gold"}])
def test_unknown_fields_and_values_stay_400(http, body):
    r = http.post(CHAT, json={"model": MODEL, "messages": USER, **body})
    err = error_body(r, 400, next(iter(body)))
    assert err["code"] in ("unknown_field", "invalid_type", "invalid_value")
    if "not_an_openai_field" in body:
        assert err["code"] == "unknown_field"
