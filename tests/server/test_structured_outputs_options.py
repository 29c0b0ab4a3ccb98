"""The server-wide structured-outputs options through a real server on the bundled SmolLM2 with the openai
SDK (`--guided-decoding-backend xgrammar:disable-any-whitespace`), and --structured-outputs-config's
`reasoning_parser` as the server's --reasoning-parser."""

from __future__ import annotations

import json

import openai
import pytest

from aserve.config import BUNDLED_MODEL_NAME
from aserve.server.args import parse_args
from tests.server.real_tiny_server import serving
from tests.server.server_harness import quiet_args

NAME_ONLY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
ASK = [{"role": "user", "content": "Give a person as JSON with the keys name, age and city."}]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_wide_compact_json_and_a_request_own_option():
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": NAME_ONLY}}
    with serving("", quiet_args(), max_model_len=256, dtype="float32",
                 guided_decoding_backend="xgrammar:disable-any-whitespace") as (_, address):
        with openai.OpenAI(base_url=f"{address.url}/v1", api_key="x", max_retries=0, timeout=120) as client:
            r = client.chat.completions.create(model=BUNDLED_MODEL_NAME, messages=ASK, max_tokens=48,
                                               temperature=0, response_format=fmt)
            text = r.choices[0].message.content
            assert text == json.dumps(json.loads(text), ensure_ascii=False)  # no newline, no indent
            with pytest.raises(openai.BadRequestError) as err:  # a request's unknown option names itself
                client.chat.completions.create(model=BUNDLED_MODEL_NAME, messages=ASK, max_tokens=8,
                                               extra_body={"guided_regex": "[a-z]+",
                                                           "guided_decoding_backend": "xgrammar:turbo"})
            assert err.value.body["param"] == "guided_decoding_backend" and "turbo" in err.value.body["message"]


def test_reasoning_parser_key_is_the_servers_reasoning_parser(capsys):
    _, server = parse_args(["--structured-outputs-config", '{"reasoning_parser": "deepseek_r1"}'], environ={})
    assert server.reasoning_parser == "deepseek_r1" and server.enable_reasoning
    _, server = parse_args(["--reasoning-parser", "qwen3", "--structured-outputs-config",
                            '{"reasoning_parser": "qwen3"}'], environ={})
    assert server.reasoning_parser == "qwen3"
    for argv, words in [(["--reasoning-parser", "qwen3", "--structured-outputs-config",
                          '{"reasoning_parser": "deepseek_r1"}'], "contradicts --reasoning-parser"),
                        (["--structured-outputs-config", '{"reasoning_parser": "nope"}'], "reasoning_parser must be")]:
        with pytest.raises(SystemExit):
            parse_args(argv, environ={})
        assert words in capsys.readouterr().err
