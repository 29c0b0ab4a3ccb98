"""`--logits-processor-pattern`: requests name logits processors by qualified name (or with constructor
args) when the name matches the server's pattern; anything else is a 400 naming `logits_processors`."""

from __future__ import annotations

import httpx
import pytest
import torch

from aserve.config import ConfigError, EngineArgs
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)
SELF = "tests.server.test_logits_processor_pattern"
FORCED = 65


def force_65(output_token_ids, logits):
    """A processor: only token 65 can be sampled."""
    out = torch.full_like(logits, float("-inf"))
    out[FORCED] = 0.0
    return out


class ForceToken:
    """A processor class built with the token it forces."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, output_token_ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[self.token] = 0.0
        return out


def _complete(client: httpx.Client, model: str, **fields):
    return client.post("/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 4,
                                                "temperature": 0, "ignore_eos": True, **fields})


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_lp"))


def test_named_processors_apply_and_others_are_refused(model):
    with serving(model, quiet_args(), logits_processor_pattern=r"tests\.server\.test_logits_processor_pattern\.",
                 distributed_executor_backend="uni") as (_, address):
        with httpx.Client(base_url=address.url, timeout=60) as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
            plain = _complete(client, name)
            forced = _complete(client, name, logits_processors=[f"{SELF}.force_65"], logprobs=0)
            built = _complete(client, name, logits_processors=[{"qualname": f"{SELF}.ForceToken", "args": [70]}],
                              logprobs=0)
            chat = client.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                "logits_processors": [f"{SELF}.force_65"], "logprobs": True})
            outside = _complete(client, name, logits_processors=["os.getcwd"])
            missing = _complete(client, name, logits_processors=[f"{SELF}.nothing_here"])
            bad_args = _complete(client, name, logits_processors=[{"qualname": f"{SELF}.ForceToken", "args": [1, 2]}])
    assert plain.status_code == forced.status_code == built.status_code == chat.status_code == 200
    tokens = forced.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 4 and len(set(tokens)) == 1
    assert built.json()["choices"][0]["logprobs"]["tokens"] != tokens  # 70, not 65
    assert len(set(built.json()["choices"][0]["logprobs"]["tokens"])) == 1
    assert len({c["token"] for c in chat.json()["choices"][0]["logprobs"]["content"]}) == 1
    for response, words in ((outside, "not allowed"), (missing, "cannot import"), (bad_args, "constructing")):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "logits_processors" and words in error["message"]


def test_without_a_pattern_no_name_is_allowed(model):
    with serving(model, quiet_args(), distributed_executor_backend="uni") as (_, address):
        with httpx.Client(base_url=address.url, timeout=60) as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
            r = _complete(client, name, logits_processors=[f"{SELF}.force_65"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "logits_processors"
    assert "--logits-processor-pattern" in r.json()["error"]["message"]


def test_a_bad_pattern_fails_at_start_up():
    with pytest.raises(ConfigError, match="--logits-processor-pattern"):
        EngineArgs(model="x", logits_processor_pattern="(unclosed").validate()
