"""Raw HTTP against a real server (the real engine over a fake model): SSE framing, every error path,
health, CORS and root path, chat templates, TLS. A request's life (disconnects, draining, engine
death) is in test_lifecycle.py."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess

import httpx
import pytest

from tests.server.server_harness import (
    CHAT,
    COMPLETIONS,
    USER,
    error_body,
    parse_sse,
    quiet_args,
    recording_engine,
    running_server,
    wait_until,
)
from tests.support.fake_model import FakeModel, build_model_folder

pytestmark = pytest.mark.timeout(60)


# -- SSE framing ------------------------------------------------------------------------------------


def test_chat_sse_framing(http):
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 3, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    payloads = parse_sse(r.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def test_completion_sse_framing_with_echo(http):
    r = http.post(COMPLETIONS, json={"prompt": "red green", "max_tokens": 2, "stream": True, "echo": True})
    payloads = parse_sse(r.content)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["text"] == "red green"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# -- errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        (CHAT, {"messages": USER, "n": "two"}, "n"),
        (CHAT, {"messages": USER, "temperature": -1}, "temperature"),
        (CHAT, {"messages": USER, "top_p": 0}, "top_p"),
        (CHAT, {"messages": USER, "presence_penalty": 3}, "presence_penalty"),
        (CHAT, {"messages": USER, "n": 0}, "n"),
        (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
        (CHAT, {"messages": USER, "bogus_field": 1}, "bogus_field"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (CHAT, {"messages": []}, "messages"),
        (CHAT, {}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
        ),
        # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice
        (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        (CHAT, {"messages": USER, "tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0]"),
        (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
        (CHAT, {"messages": USER, "guided_json": "{not json"}, "guided_json"),
        (CHAT, {"messages": USER, "logit_bias": {"abc": 1}}, "logit_bias"),
        (CHAT, {"messages": USER, "logit_bias": {"99999": 1}}, "logit_bias"),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        (CHAT, {"messages": USER, "stop_token_ids": [99999]}, "stop_token_ids"),
        (CHAT, {"messages": USER, "stop": [""]}, "stop"),
        (
            CHAT,
            {"messages": USER, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        (CHAT, {"messages": USER, "chat_template": "{% for %}"}, "chat_template"),
        (CHAT, {"messages": USER, "chat_template": "{{ raise_exception('nope') }}"}, "messages"),
        (CHAT, {"messages": USER, "chat_template": "{{ ''.__class__.__mro__ }}"}, "messages"),
        (CHAT, {"messages": USER, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        (COMPLETIONS, {"prompt": "hi", "suffix": "bye"}, "suffix"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 50}, "logprobs"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
        (COMPLETIONS, {"prompt": "hi", "best_of": 3, "n": 1, "stream": True}, "best_of"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (COMPLETIONS, {"prompt": [[]]}, "prompt[0]"),
        (COMPLETIONS, {"prompt": [123456789]}, "prompt"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(http, path, body, param):
    err = error_body(http.post(path, json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_malformed_json_and_empty_body(http):
    truncated = http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert error_body(truncated, 400)["code"] == "invalid_json"
    assert error_body(http.post(COMPLETIONS, content=b""), 400)["code"] == "invalid_json"
    error_body(http.post(CHAT, content=b"[1, 2]"), 400)


def test_context_length(http, tokenizer):
    long_prompt = " ".join(["alpha"] * 300)  # > max_model_len (256) tokens
    err = error_body(http.post(COMPLETIONS, json={"prompt": long_prompt}), 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "256" in err["message"]
    prompt_len = len(tokenizer.encode("alpha beta"))
    err = error_body(
        http.post(COMPLETIONS, json={"prompt": "alpha beta", "max_tokens": 256 - prompt_len + 1}),
        400,
        "max_tokens",
    )
    assert "256" in err["message"]
    ok = http.post(COMPLETIONS, json={"prompt": "alpha beta", "max_tokens": 256 - prompt_len})
    assert ok.status_code == 200
    err = error_body(
        http.post(CHAT, json={"messages": [{"role": "user", "content": long_prompt}]}), 400, "messages"
    )
    assert err["code"] == "context_length_exceeded"
    error_body(
        http.post(CHAT, json={"messages": USER, "max_completion_tokens": 1000}), 400, "max_completion_tokens"
    )
    truncated = http.post(
        COMPLETIONS, json={"prompt": long_prompt, "truncate_prompt_tokens": 10, "max_tokens": 2}
    )
    assert truncated.status_code == 200 and truncated.json()["usage"]["prompt_tokens"] == 10
    chat = http.post(
        CHAT, json={"messages": USER, "truncate_prompt_tokens": 3, "max_tokens": 2, "echo": False}
    )
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == 3


def test_chat_default_max_tokens_fills_the_context(server, engine):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        with client.stream("POST", CHAT, json={"messages": USER, "stream": True, "max_tokens": None}) as r:
            assert next(r.iter_lines()).startswith("data: ")
            added = engine.added[-1]
    assert added.params.max_tokens == 256 - len(added.prompt_token_ids)
    wait_until(lambda: added.request_id not in engine.streams)  # finished, or aborted by the disconnect
    full = httpx.post(f"{server.url}{CHAT}", json={"messages": USER, "max_tokens": None}, timeout=30).json()
    assert full["usage"]["total_tokens"] == 256 and full["choices"][0]["finish_reason"] == "length"


def test_unknown_model_404(http):
    err = error_body(http.post(CHAT, json={"model": "gpt-4", "messages": USER}), 404, "model")
    assert err["code"] == "model_not_found"
    error_body(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model")


def test_routing_errors_use_openai_format(http):
    assert error_body(http.get("/v1/nothing-here"), 404)["code"] == "not_found"
    error_body(http.get(CHAT), 405)
    error_body(http.post("/tokenize", json={}), 400, "prompt")
    error_body(http.post("/tokenize", json={"prompt": "a", "messages": USER}), 400, "prompt")
    error_body(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    error_body(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_version_and_health(http):
    assert http.get("/version").json()["version"]
    r = http.get("/health")
    assert r.status_code == 200 and r.content == b""


# -- CORS, root path ----------------------------------------------------------------------------------


def test_cors_preflight_and_simple_request(http):
    pre = http.options(
        CHAT,
        headers={
            "Origin": "http://a.test",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] in ("*", "http://a.test")
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = http.get("/v1/models", headers={"Origin": "http://a.test"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_restricted_cors_and_root_path(model_folder, fake_model):
    args = quiet_args(allowed_origins=("http://good.test",), root_path="/api")
    with running_server(lambda: recording_engine(model_folder, fake_model), args) as srv:
        with httpx.Client(base_url=srv.url) as client:
            ok = client.options(
                CHAT, headers={"Origin": "http://good.test", "Access-Control-Request-Method": "POST"}
            )
            assert ok.headers["access-control-allow-origin"] == "http://good.test"
            bad = client.options(
                CHAT, headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"}
            )
            assert bad.status_code == 400
            assert client.get("/api/v1/models").json()["data"][0]["id"] == "fake-model"
            assert client.get("/v1/models").status_code == 200
            assert (
                client.post("/api/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
            )


def test_no_chat_template_is_a_clear_400(tmp_path):
    plain = build_model_folder(tmp_path, special_tokens=("<|endoftext|>",))
    with running_server(lambda: recording_engine(plain, FakeModel.for_folder(plain)), quiet_args()) as srv:
        with httpx.Client(base_url=srv.url) as client:
            err = error_body(client.post(CHAT, json={"messages": USER}), 400, "chat_template")
            assert err["code"] == "no_chat_template" and "--chat-template" in err["message"]
            inline = client.post(
                CHAT,
                json={
                    "messages": USER,
                    "max_tokens": 2,
                    "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
                },
            )
            assert inline.status_code == 200
            assert client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_chat_template_flag_overrides(model_folder, fake_model, tokenizer):
    args = quiet_args(chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    with running_server(lambda: recording_engine(model_folder, fake_model), args) as srv:
        with httpx.Client(base_url=srv.url) as client:
            assert client.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200
        assert tokenizer.decode(srv.engine.added[-1].prompt_token_ids) == "[user] hello\n"


def test_tls(model_folder, fake_model, tmp_path):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    args = quiet_args(ssl_keyfile=str(key), ssl_certfile=str(cert))
    with running_server(lambda: recording_engine(model_folder, fake_model), args) as srv:
        url = f"https://127.0.0.1:{srv.address.port}"
        with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(cert))) as client:
            assert client.get("/health").status_code == 200
            r = client.post(COMPLETIONS, json={"prompt": "secure", "max_tokens": 2, "stream": True})
            assert parse_sse(r.content)[-1] == "[DONE]"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{srv.address.port}/health", timeout=5)
