"""Speculative decoding through the OpenAI server: streamed completions and chat identical to a server
without speculation (n-gram lookup, and a draft model that always agrees: the target itself), several
tokens per chunk while drafts are accepted, and the spec_decode_* counters on /metrics."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

pytestmark = pytest.mark.timeout(300)

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny_spec_served"))


def _stream(url: str) -> tuple[str, list[str], str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    chunks = [c.choices[0].text for c in client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].text]
    chat = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=24, temperature=0,
                                          messages=[{"role": "user", "content": PROMPT}])
    return "".join(chunks), chunks, chat.choices[0].message.content


def _counter(metrics: str, name: str) -> float:
    match = re.search(rf"^vllm:{name}_total{{[^}}]*}} ([0-9.e+]+)$", metrics, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(scope="module")
def reference(model):
    with serving(model, quiet_args()) as (_, address):
        return _stream(address.url)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_streamed_outputs_identical_with_speculation(method, model, reference):
    spec = NGRAM if method == "ngram" else {"model": model, "num_speculative_tokens": 3}
    with serving(model, quiet_args(), speculative_config=spec) as (_, address):
        text, chunks, chat = _stream(address.url)
        metrics = httpx.get(f"{address.url}/metrics").text
    assert (text, chat) == (reference[0], reference[2])
    drafted = _counter(metrics, "spec_decode_num_draft_tokens")
    accepted = _counter(metrics, "spec_decode_num_accepted_tokens")
    assert drafted > 0 and accepted > 0 and _counter(metrics, "spec_decode_num_drafts") > 0
    if method == "draft_model":
        assert accepted == drafted  # the target drafting for itself
        assert len(chunks) < len(reference[1])  # several tokens per chunk
