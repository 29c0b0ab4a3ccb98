"""The official `openai` SDK (sync and async, streaming and not) against a real server on 127.0.0.1
(the real engine over a fake model): models, chat, concurrency. Completions are in
test_openai_sdk_completions.py."""

from __future__ import annotations

import anyio
import httpx
import openai
import pytest

from tests.server.server_harness import (
    CHATML_USER,
    MODEL,
    expected_text,
    last_added,
    quiet_args,
    recording_engine,
    running_server,
)
from tests.support.fake_model import FakeModel

pytestmark = pytest.mark.timeout(60)



def test_models_list(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["fake-model", "fake-alias"]


def test_chat_greedy_uses_chatml_prompt_and_returns_engine_text(client, engine, tokenizer, fake_model):
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello world"}], temperature=0, max_tokens=6
    )
    prompt_ids, params = last_added(engine)
    assert prompt_ids == tokenizer.encode(CHATML_USER.format("hello world"), add_special_tokens=False)
    assert params.max_tokens == 6 and params.temperature == 0
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(fake_model, tokenizer, prompt_ids, params)
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 6
    assert resp.usage.total_tokens == len(prompt_ids) + 6
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL and resp.created > 0
    assert resp.system_fingerprint


def test_chat_alias_model_name_is_echoed(client):
    resp = client.chat.completions.create(
        model="fake-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert resp.model == "fake-alias"


def test_chat_content_parts_and_system_role(client, engine, tokenizer):
    client.chat.completions.create(
        model=MODEL,
        max_tokens=2,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "three"},
            {"role": "user", "content": "four"},
        ],
    )
    prompt_ids, _ = last_added(engine)
    expected = (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\none\ntwo<|im_end|>\n"
        "<|im_start|>assistant\nthree<|im_end|>\n" + CHATML_USER.format("four")
    )
    assert tokenizer.decode(prompt_ids) == expected


def test_chat_stream_matches_non_stream(client, engine, tokenizer):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    choice_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in choice_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_chat_continuous_usage_stats(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)


def test_chat_n_with_seed_gives_distinct_indexed_choices(client, engine, tokenizer, fake_model):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "many"}],
        n=3,
        seed=11,
        temperature=1.0,
        max_tokens=5,
    )
    prompt_ids, params = last_added(engine)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        assert c.message.content == expected_text(fake_model, tokenizer, prompt_ids, params, c.index)
    assert len({c.message.content for c in resp.choices}) == 3
    assert resp.usage.completion_tokens == 15


def test_chat_stream_n_tracks_each_index(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "many"}], n=2, seed=3, max_tokens=4, stream=True
    )
    texts, finish = {0: "", 1: ""}, {}
    roles = set()
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0, 1}
    assert finish == {0: "length", 1: "length"}
    full = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "many"}], n=2, seed=3, max_tokens=4
    )
    assert texts == {c.index: c.message.content for c in full.choices}


def test_seed_reproducibility(client):
    def ask(seed):
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "random"}],
                temperature=1.0,
                seed=seed,
                max_tokens=8,
            )
            .choices[0]
            .message.content
        )

    assert ask(5) == ask(5)
    assert ask(5) != ask(6)


def test_chat_stop_string(client, engine, tokenizer, fake_model):
    messages = [{"role": "user", "content": "stop test"}]
    free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=10)
    prompt_ids, params = last_added(engine)
    tokens = fake_model.expected_token_ids(prompt_ids, params)
    stop_word = tokenizer.decode([tokens[4]])
    first = tokenizer.decode(tokens).find(stop_word)
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=10, stop=[stop_word]
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == free.choices[0].message.content[:first]
    assert choice.model_extra["stop_reason"] == stop_word


def test_chat_logprobs(client, engine, tokenizer):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "lp"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    for e in content:
        assert e.logprob < 0
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token  # the fake's sampled token has rank 1
        assert e.bytes == list(e.token.encode())


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
REQUIRED_TOOLS = [{"type": "function", "function": {"name": name, "parameters": CITY}} for name in ("a", "b")]
CUT_CALLS = '[{"name": "a", "parameters": {"city": "Oslo"}}, {"name": "b", "parameters": {"city": "Ro'


@pytest.fixture(scope="module")
def cut_calls_client(model_folder, tokenizer):
    """A server whose fake model writes CUT_CALLS first (its tools prompt needs more than 256 tokens)."""
    fake = FakeModel.for_folder(model_folder)
    fake.script = tokenizer.encode(CUT_CALLS, add_special_tokens=False)
    def make():
        return recording_engine(model_folder, fake, max_model_len=1024)

    with running_server(make, quiet_args()) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        yield c, len(fake.script)


def test_required_tool_calls_cut_by_max_tokens_stream_as_they_answer(cut_calls_client):
    """tool_choice "required" cut by max_tokens inside its second call: the stream carries only the call
    that completed, as the non-streamed answer does, and every token's logprobs (those of the held-back
    text ride on a later chunk)."""
    client, num_tokens = cut_calls_client
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "tools": REQUIRED_TOOLS,
          "tool_choice": "required", "max_tokens": num_tokens, "logprobs": True, "temperature": 0}
    full = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert full.finish_reason == "length" and full.message.content is None
    expected = [("a", '{"city": "Oslo"}')]
    assert [(c.function.name, c.function.arguments) for c in full.message.tool_calls] == expected
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
    assert [tuple(c) for c in calls.values()] == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]
    assert not any(c.choices[0].delta.content for c in chunks)
    streamed = [e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in full.logprobs.content] and len(streamed) == num_tokens


def test_chat_extra_vllm_fields_reach_sampling_params(client, engine):
    client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_completion_tokens=3,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias={"5": 1.0},
        user="u1",
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.1,
            "min_tokens": 1,
            "ignore_eos": True,
            "stop_token_ids": [3],
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "spaces_between_special_tokens": False,
            "priority": 2,
        },
    )
    added = engine.added[-1]
    params, priority = added.params, added.priority
    assert (params.max_tokens, params.presence_penalty, params.frequency_penalty) == (3, 0.5, 0.25)
    assert params.logit_bias == {5: 1.0}
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (5, 0.1, 1.1, 1)
    assert params.ignore_eos and params.stop_token_ids == [3] and not params.skip_special_tokens
    assert params.include_stop_str_in_output and not params.spaces_between_special_tokens
    assert priority == 2


def test_chat_echo_and_continue_final_message(client, engine, tokenizer, fake_model):
    resp = client.chat.completions.create(
        model=MODEL,
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": "finish this"}, {"role": "assistant", "content": "the quick"}],
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )
    prompt_ids, params = last_added(engine)
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\nthe quick")
    text = resp.choices[0].message.content
    assert text == "the quick" + expected_text(fake_model, tokenizer, prompt_ids, params)


@pytest.mark.anyio
async def test_async_client_stream_and_non_stream(server, engine, tokenizer):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        full = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "async"}], temperature=0, max_tokens=5
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "async"}],
            temperature=0,
            max_tokens=5,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == full.choices[0].message.content
        comp = await client.completions.create(model=MODEL, prompt="async", max_tokens=3, stream=True)
        pieces = [c.choices[0].text async for c in comp]
        assert len(pieces) == 3


@pytest.mark.anyio
async def test_32_concurrent_streams_complete_with_correct_text(server, engine, tokenizer, fake_model):
    words = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "one"]
    prompts = [f"{words[i % 8]} {words[(i // 8) % 8]} {i}" for i in range(32)]

    async def one(client, prompt):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=12,
            stream=True,
        )
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    results: dict[str, tuple[str, str]] = {}
    limits = httpx.Limits(max_connections=64)
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="x", max_retries=0, http_client=httpx.AsyncClient(limits=limits)
    ) as client, anyio.create_task_group() as tg:

        async def run(p):
            results[p] = await one(client, p)

        for p in prompts:
            tg.start_soon(run, p)
    params = engine.added[-1].params
    for p in prompts:
        prompt_ids = tokenizer.encode(CHATML_USER.format(p), add_special_tokens=False)
        expected = tokenizer.decode(fake_model.expected_token_ids(prompt_ids, params))
        assert results[p] == (expected, "length")
