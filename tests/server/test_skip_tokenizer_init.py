"""--skip-tokenizer-init: the server starts without a tokenizer, serves token-id prompts on
/v1/completions (empty text, `token_id:<id>` logprob tokens) and answers text prompts and chat with a
400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_no_tokenizer"))
    with serving(path, quiet_args(), skip_tokenizer_init=True) as (_, address):
        with httpx.Client(base_url=address.url, timeout=60) as c:
            yield c


def _error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "skip-tokenizer-init" in err["message"], err


def test_token_id_prompts_are_served(client):
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 2,
            "echo": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == ""
    tokens = choice["logprobs"]["tokens"]
    assert tokens[:3] == ["token_id:5", "token_id:6", "token_id:7"] and len(tokens) == 3 + 4
    assert all(t.startswith("token_id:") for t in tokens)
    r = client.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 2, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hello", "max_tokens": 1}, "prompt"),
    ({"prompt": ["hello", "world"], "max_tokens": 1}, "prompt"),
])
def test_text_prompts_are_a_400(client, body, param):
    _error(client.post("/v1/completions", json=body), param)


def test_chat_is_a_400(client):
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), "messages")


def test_stop_strings_need_text(client):
    r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1, "stop": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/detokenize", {"tokens": [5, 6]}, "tokens"),
])
def test_tokenize_and_detokenize_are_a_400(client, path, body, param):
    _error(client.post(path, json=body), param)
