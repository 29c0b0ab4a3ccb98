"""--tokenizer-mode mistral: mistral_common's tokenizer (a real Mistral instruct tokenizer file shipped
in the mistral_common wheel) in front of a tiny random model with its vocabulary. Chats are encoded by
mistral_common itself (the prompt ids are exactly its ChatCompletionRequest encoding), text is decoded
by it, grammars run over its vocabulary, and a chat_template is refused by name. The same server runs
with --num-scheduler-steps 3, so streamed chats also cross multi-step calls."""

from __future__ import annotations

import os
import shutil
from functools import partial

import anyio
import anyio.from_thread
import openai
import pytest

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, EngineArgs
from aserve.sampling_params import GuidedDecodingParams
from aserve.server.launch import serve
from tests.server.server_harness import quiet_args
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

mistral_common = pytest.importorskip("mistral_common")
TOKENIZER_FILE = "mistral_instruct_tokenizer_241114.model.v7"  # SentencePiece, 32768 ids
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_mistral")
    save_tiny_hf(path, "llama", seed=5, perturb=False, tie_word_embeddings=True, **{**GREEDY_STABLE, "vocab_size": 32768})
    shutil.copy(os.path.join(os.path.dirname(mistral_common.__file__), "data", TOKENIZER_FILE),
                path / "tokenizer.model.v7")
    return str(path)


def _mistral_chat_ids(folder: str, messages: list[dict]) -> list[int]:
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.from_file(os.path.join(folder, "tokenizer.model.v7"))
    return tok.encode_chat_completion(ChatCompletionRequest(messages=messages)).tokens


def test_offline_text_and_chat_go_through_mistral_common(folder):
    llm = LLM(folder, dtype="float32", max_model_len=128, tokenizer_mode="mistral")
    tok = llm.get_tokenizer()
    assert type(tok).__name__ == "MistralCommonBackend"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate(["Hello there, how"], greedy, use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode("Hello there, how")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    chat = llm.chat(MESSAGES, greedy, use_tqdm=False)[0]
    assert chat.prompt_token_ids == _mistral_chat_ids(folder, MESSAGES)
    pick = SamplingParams(temperature=0, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=["red", "blue"]))
    assert llm.generate(["Pick:"], pick, use_tqdm=False)[0].outputs[0].text in ("red", "blue")


def test_missing_tokenizer_file_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match="--tokenizer-mode mistral: cannot load a Mistral tokenizer"):
        LLM(tiny_llama, dtype="float32", max_model_len=64, tokenizer_mode="mistral")


@pytest.fixture(scope="module")
def client(folder):
    from aserve.engine.async_engine import AsyncEngine

    args = EngineArgs(model=folder, dtype="float32", max_model_len=256, tokenizer_mode="mistral",
                      num_scheduler_steps=3, cpu_kvcache_space=0.05)
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        engine = portal.call(AsyncEngine.from_engine_args, args)
        stop = portal.call(anyio.Event)
        server_args = quiet_args(host="127.0.0.1", port=0)
        future, address = portal.start_task(partial(serve, engine, server_args, stop=stop, handle_signals=False))
        try:
            with openai.OpenAI(base_url=f"{address.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
                yield c, folder
        finally:
            portal.call(stop.set)
            future.result(timeout=60)


def test_server_chat_streams_the_same_text_over_multi_step_calls(client):
    c, folder = client
    kwargs = {"model": folder, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = c.chat.completions.create(**kwargs)
    assert whole.usage.prompt_tokens == len(_mistral_chat_ids(folder, MESSAGES))
    assert whole.usage.completion_tokens == 12
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kwargs)
              if ch.choices]
    assert "".join(pieces) == whole.choices[0].message.content
    assert sum(1 for p in pieces if p) > 1  # streamed in several chunks


def test_server_refuses_a_chat_template_and_serves_json_schema(client):
    c, folder = client
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model=folder, messages=MESSAGES, max_tokens=4,
                                  extra_body={"chat_template": "{{ messages }}"})
    assert "chat_template" in str(err.value)
    schema = {"type": "string", "enum": ["red", "blue"]}
    resp = c.chat.completions.create(model=folder, messages=MESSAGES, max_tokens=10, temperature=0,
                                     response_format={"type": "json_schema",
                                                      "json_schema": {"name": "r", "schema": schema}})
    assert resp.choices[0].message.content in ('"red"', '"blue"')


def test_chat_template_flag_with_mistral_mode_fails_at_start_up(capsys):
    from aserve.server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--tokenizer-mode", "mistral", "--chat-template", "{{ messages }}"])
    assert exc.value.code == 2
    assert "--chat-template: --tokenizer-mode mistral" in capsys.readouterr().err
