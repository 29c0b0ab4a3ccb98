"""Hostile and malformed requests against a real server with the real engine on a tiny random model:
each is a 4xx in OpenAI's error format naming the field, and the server stays healthy. Every request
limit (aserve.sampling_params MAX_*, --max-logprobs, max_model_len) is tried at the cap and one past it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from aserve.sampling_params import (
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from tests.server.real_tiny_server import TINY_MAX_MODEL_LEN, build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(600)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_LOGPROBS = 20  # the server's --max-logprobs (vLLM's default)
HUGE = 2**64 + 7  # beyond int64 and uint64
USER = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_served"), vocab_size=1536)
    with serving(path, quiet_args(), max_logprobs=MAX_LOGPROBS) as (_, address):
        with httpx.Client(base_url=address.url, timeout=120) as client:
            yield client


def _post(client: httpx.Client, route: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(route, content=content, headers={"content-type": "application/json"})


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello world", "max_tokens": 1, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 1, **fields}


def _nested(depth: int) -> Any:
    """A JSON value of `depth` levels of arrays."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _raw(prefix: str, literal: str, route: str = COMPLETIONS) -> bytes:
    """A body whose last field is the literal `literal` (something json.dumps cannot write)."""
    base = json.dumps(_completion() if route == COMPLETIONS else _chat())[:-1]
    return f'{base}, "{prefix}": {literal}}}'.encode()


NUMERIC_COMPLETION_FIELDS = ["n", "best_of", "seed", "max_tokens", "min_tokens", "logprobs", "top_k",
                             "truncate_prompt_tokens", "prompt_logprobs", "priority", "temperature", "top_p",
                             "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
NUMERIC_CHAT_FIELDS = ["top_logprobs", "max_completion_tokens", "max_tokens"]

# (id, route, body, param): each must be a 400 whose error.param is `param`.
HOSTILE: list[tuple[str, str, Any, str | None]] = [
    ("non-utf8-value", COMPLETIONS, b'{"prompt": "\xff\xfe hi", "max_tokens": 1}', "prompt"),
    ("non-utf8-chat", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', "content"),
    ("non-utf8-garbage", COMPLETIONS, b"\xff\xfe\x00\x01", None),
    ("nan", COMPLETIONS, _raw("temperature", "NaN"), "temperature"),
    ("infinity", COMPLETIONS, _raw("top_p", "Infinity"), "top_p"),
    ("-infinity", CHAT, _raw("presence_penalty", "-Infinity", CHAT), "presence_penalty"),
    ("overflowing-float", COMPLETIONS, _raw("temperature", "1e999"), "temperature"),
    *[(f"huge-int-{f}", COMPLETIONS, _completion(**{f: HUGE}), f) for f in NUMERIC_COMPLETION_FIELDS],
    *[(f"huge-int-chat-{f}", CHAT, _chat(logprobs=True, **{f: HUGE}), f) for f in NUMERIC_CHAT_FIELDS],
    ("huge-negative-seed", COMPLETIONS, _completion(seed=-HUGE), "seed"),
    ("huge-stop-token-id", COMPLETIONS, _completion(stop_token_ids=[HUGE]), "stop_token_ids"),
    ("huge-logit-bias-key", COMPLETIONS, _completion(logit_bias={str(HUGE): 1}), "logit_bias"),
    ("huge-logit-bias-value", COMPLETIONS, _completion(logit_bias={"1": HUGE}), "logit_bias"),
    ("huge-token-id-prompt", COMPLETIONS, {"prompt": [1, HUGE], "max_tokens": 1}, "prompt"),
    ("huge-token-id-batch", COMPLETIONS, {"prompt": [[1], [HUGE]], "max_tokens": 1}, "prompt[1]"),
    ("deep-nesting", CHAT, _chat(chat_template_kwargs={"x": _nested(MAX_JSON_DEPTH)}), "chat_template_kwargs"),
    ("very-deep-nesting", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("10000-stop-strings", COMPLETIONS, _completion(stop=[f"s{i}" for i in range(10_000)]), "stop"),
    ("1e6-token-prompt", COMPLETIONS, {"prompt": [7] * 10**6, "max_tokens": 1}, "prompt"),
    ("1e6-token-text-prompt", COMPLETIONS, _completion(prompt="hello " * 10**6), "prompt"),
    ("1e6-token-chat", CHAT, {"messages": [{"role": "user", "content": "hello " * 10**6}]}, "messages"),
    ("1e5-logit-bias", COMPLETIONS, _completion(logit_bias={str(i): 1 for i in range(10**5)}), "logit_bias"),
    ("empty-body", COMPLETIONS, b"", None),
    ("empty-object", COMPLETIONS, {}, "prompt"),
    ("empty-prompt", COMPLETIONS, _completion(prompt=""), "prompt"),
    ("empty-prompt-list", COMPLETIONS, _completion(prompt=[]), "prompt"),
    ("empty-token-list", COMPLETIONS, _completion(prompt=[[]]), "prompt[0]"),
    ("empty-messages", CHAT, {"messages": []}, "messages"),
    ("empty-stop", COMPLETIONS, _completion(stop=""), "stop"),
    ("empty-role", CHAT, {"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ("string-n", COMPLETIONS, _completion(n="2"), "n"),
    ("bool-max-tokens", COMPLETIONS, _completion(max_tokens=True), "max_tokens"),
    ("float-seed", COMPLETIONS, _completion(seed=1.5), "seed"),
    ("number-prompt", COMPLETIONS, {"prompt": 5}, "prompt"),
    ("mixed-prompt", COMPLETIONS, _completion(prompt=["a", 1]), "prompt"),
    ("string-messages", CHAT, {"messages": "hi"}, "messages"),
    ("string-stream", CHAT, _chat(stream="yes"), "stream"),
    ("string-bias", COMPLETIONS, _completion(logit_bias={"1": "x"}), "logit_bias"),
    ("word-bias-key", COMPLETIONS, _completion(logit_bias={"one": 1}), "logit_bias"),
    ("array-body", COMPLETIONS, b"[1, 2]", None),
    ("unknown-top-level", COMPLETIONS, _completion(temprature=0.5), "temprature"),
    ("unknown-message-key", CHAT, {"messages": [{"role": "tool", "content": "x", "tool_cal_id": "1"}]},
     "messages[0].tool_cal_id"),
    ("unknown-part-key", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages[0].content[0].x"),
    ("unknown-part-type", CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
     "messages[0].content[0].type"),
    ("unsupported-modality", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages[0].content[0].type"),
    ("unknown-image-key", CHAT,
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "size": 1}}]}]},
     "messages[0].content[0].image_url.size"),
    ("negative-top-logprobs", CHAT, _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), "top_logprobs"),
    ("top-k-past-vocab", COMPLETIONS, _completion(top_k=10**6), "top_k"),
    ("token-id-past-vocab", COMPLETIONS, {"prompt": [10**6], "max_tokens": 1}, "prompt"),
    ("negative-token-id", COMPLETIONS, {"prompt": [-1], "max_tokens": 1}, "prompt"),
]


def _check_error(r: httpx.Response, param: str | None) -> dict[str, Any]:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and err["type"] == "invalid_request_error" and err["code"]
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("route, body, param", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_input_is_a_4xx_naming_the_field(server, route, body, param):
    _check_error(_post(server, route, body), param)
    assert server.get("/health").status_code == 200


def test_non_utf8_and_context_errors_have_their_codes(server):
    r = _post(server, COMPLETIONS, b'{"prompt": "\xff"}')
    assert _check_error(r, "prompt")["code"] == "invalid_encoding"
    r = _post(server, COMPLETIONS, {"prompt": [7] * TINY_MAX_MODEL_LEN, "max_tokens": 1})
    assert _check_error(r, "prompt")["code"] == "context_length_exceeded"
    r = _post(server, CHAT, _chat(max_completion_tokens=TINY_MAX_MODEL_LEN))
    assert _check_error(r, "max_completion_tokens")["code"] == "context_length_exceeded"


# (id, route, field, body at the cap, body one past it): the first is a 200, the second a 400 naming `field`.
CAPS: list[tuple[str, str, str, dict[str, Any], dict[str, Any]]] = [
    ("n", COMPLETIONS, "n", _completion(n=MAX_N), _completion(n=MAX_N + 1)),
    ("seed-max", COMPLETIONS, "seed", _completion(n=2, seed=2**63 - 1, max_tokens=3), _completion(seed=2**63)),
    ("seed-min", CHAT, "seed", _chat(n=2, seed=-(2**63), max_tokens=3), _chat(seed=-(2**63) - 1)),
    ("best_of", COMPLETIONS, "best_of", _completion(best_of=MAX_N), _completion(best_of=MAX_N + 1)),
    ("stop-count", COMPLETIONS, "stop", _completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)]),
     _completion(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])),
    ("stop-length", CHAT, "stop", _chat(stop="x" * MAX_STOP_STRING_CHARS),
     _chat(stop="x" * (MAX_STOP_STRING_CHARS + 1))),
    ("stop-token-ids", COMPLETIONS, "stop_token_ids", _completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))),
     _completion(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))),
    ("logit-bias", COMPLETIONS, "logit_bias", _completion(logit_bias={str(i): 0 for i in range(MAX_LOGIT_BIAS_ENTRIES)}),
     _completion(logit_bias={str(i): 0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)})),
    ("top-logprobs", CHAT, "top_logprobs", _chat(logprobs=True, top_logprobs=MAX_LOGPROBS),
     _chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1)),
    ("logprobs", COMPLETIONS, "logprobs", _completion(logprobs=MAX_LOGPROBS), _completion(logprobs=MAX_LOGPROBS + 1)),
    ("prompt-logprobs", COMPLETIONS, "prompt_logprobs", _completion(prompt_logprobs=MAX_LOGPROBS),
     _completion(prompt_logprobs=MAX_LOGPROBS + 1)),
    ("prompt-length", COMPLETIONS, "prompt", {"prompt": [7] * (TINY_MAX_MODEL_LEN - 1), "max_tokens": 1},
     {"prompt": [7] * TINY_MAX_MODEL_LEN, "max_tokens": 1}),
    ("max-tokens", COMPLETIONS, "max_tokens", {"prompt": [7] * 8, "max_tokens": TINY_MAX_MODEL_LEN - 8},
     {"prompt": [7] * 8, "max_tokens": TINY_MAX_MODEL_LEN - 7}),
    ("truncate", COMPLETIONS, "truncate_prompt_tokens", _completion(truncate_prompt_tokens=TINY_MAX_MODEL_LEN),
     _completion(truncate_prompt_tokens=TINY_MAX_MODEL_LEN + 1)),
    ("prompts", COMPLETIONS, "prompt", _completion(prompt=[[7]] * MAX_PROMPTS),
     _completion(prompt=[[7]] * (MAX_PROMPTS + 1))),
    ("nesting", CHAT, "chat_template_kwargs", _chat(chat_template_kwargs={"x": _nested(MAX_JSON_DEPTH - 2)}),
     _chat(chat_template_kwargs={"x": _nested(MAX_JSON_DEPTH - 1)})),
]


@pytest.mark.parametrize("route, field, at_cap, past_cap", [c[1:] for c in CAPS], ids=[c[0] for c in CAPS])
def test_each_limit_holds_at_the_cap_and_fails_past_it(server, route, field, at_cap, past_cap):
    r = _post(server, route, at_cap)
    assert r.status_code == 200, r.text[:500]
    _check_error(_post(server, route, past_cap), field)


def test_the_server_still_serves_after_the_table(server):
    r = _post(server, COMPLETIONS, {"prompt": "hello world", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    r = _post(server, CHAT, _chat(max_tokens=3, temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert server.get("/health").status_code == 200
