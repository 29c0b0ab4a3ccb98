"""/openapi.json and /docs on a live server (real engine, tiny model, an API key set): the document
covers every route, real answers conform to it, and, as in vLLM, both pages are open without the key."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from tests.server.real_tiny_server import build_tiny_chat_model, serving
from tests.server.server_harness import quiet_args

from aserve.server.app import create_app

KEY = "sk-test"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    with serving(model, quiet_args(api_key=KEY)) as (engine, address):
        yield engine, address


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live[1].url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture(scope="module")
def doc(live) -> dict[str, Any]:
    with httpx.Client(base_url=live[1].url, timeout=60) as anonymous:
        response = anonymous.get("/openapi.json")
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    return response.json()


def _conforms(doc: dict[str, Any], schema: dict[str, Any], value: Any) -> None:
    """Validate `value` against `schema`, whose $refs point into `doc`'s components."""
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(value)


def _ok_schema(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]


def test_document_lists_every_route_the_app_serves(live, doc):
    engine, _ = live
    app = create_app(engine, quiet_args(api_key=KEY))
    served = {
        (method.lower(), route.path)
        for route in app.routes
        for method in route.methods - {"HEAD"}
        if route.path not in ("/openapi.json", "/docs")
    }
    documented = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == served
    assert ("post", "/reset_prefix_cache") in documented and ("post", "/tokenize") in documented
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    assert doc["components"]["responses"]["Error"]["content"]["application/json"]["schema"] == error
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["responses"]["4XX"] == {"$ref": "#/components/responses/Error"}, (method, path)
            keyed = path.startswith("/v1") or path in ("/reset_prefix_cache", "/score", "/rerank", "/v2/rerank",
                                                       "/classify", "/sleep", "/wake_up", "/is_sleeping",
                                                       "/dashboard", "/dashboard/data")
            # (outside /v1: state changes, model runs, the dashboard)
            assert ("security" in op) == keyed, path
            if method == "post" and path not in ("/reset_prefix_cache", "/sleep", "/wake_up", "/ping"):
                ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[-1] in doc["components"]["schemas"]
    # requests forbid unknown fields, and the document says so
    assert doc["components"]["schemas"]["CompletionRequest"]["additionalProperties"] is False


def test_schemathesis_loads_every_operation(live):
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]')")
    schema = schemathesis.openapi.from_url(f"{live[1].url}/openapi.json")
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"} <= labels


def test_real_answers_conform_to_the_document(http, doc):
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"messages": messages, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200
    _conforms(doc, _ok_schema(doc, "post", "/v1/chat/completions"), r.json())
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "logprobs": 1, "echo": True})
    assert r.status_code == 200
    _conforms(doc, _ok_schema(doc, "post", "/v1/completions"), r.json())
    r = http.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True})
    _conforms(doc, _ok_schema(doc, "post", "/tokenize"), r.json())
    r = http.post("/detokenize", json={"tokens": r.json()["tokens"]})
    _conforms(doc, _ok_schema(doc, "post", "/detokenize"), r.json())
    for path in ("/v1/models", "/version"):
        _conforms(doc, _ok_schema(doc, "get", path), http.get(path).json())
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": -1})
    assert r.status_code == 400
    _conforms(doc, {"$ref": "#/components/schemas/ErrorResponse"}, r.json())


def test_streamed_chunks_conform_to_the_chunk_schema(http, doc):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "text/event-stream" in doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    for event in events[:-1]:
        _conforms(doc, {"$ref": "#/components/schemas/ChatCompletionChunk"}, json.loads(event))


def test_docs_page_is_open_and_names_every_operation_and_schema(live, doc):
    with httpx.Client(base_url=live[1].url, timeout=60) as anonymous:
        r = anonymous.get("/docs")
        assert anonymous.get("/v1/models").status_code == 401  # the key is really required elsewhere
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<script" not in r.text and "://" not in r.text  # loads nothing from elsewhere: works offline
    for path in doc["paths"]:
        assert f"<code>{path}</code>" in r.text
    for name in doc["components"]["schemas"]:
        assert f"id='{name}'" in r.text
