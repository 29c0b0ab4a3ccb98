"""Structured outputs, tool calling and reasoning through the real server with the openai SDK.

One real server per module on the bundled SmolLM2 (dtype auto: bf16 where the CPU has it, which is
what users get; `--enable-auto-tool-choice --tool-call-parser hermes`): grammar-constrained chat and completions outputs validate (jsonschema, re.fullmatch, the
choice list), a spec that does not compile is a 400 naming its field, forced tool calls carry arguments
that validate against the tool's schema and stream to the same call; LangChain's ChatOpenAI
`with_structured_output` and `bind_tools` work against it (with no network: nothing may reach
tiktoken's encodings download, so no token counting). Reasoning runs over the fake
model (SmolLM2 never says `<think>`), scripted to say "<think>...</think>...", with `--reasoning-parser
deepseek_r1`."""

from __future__ import annotations

import json
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from aserve.config import BUNDLED_MODEL_NAME
from tests.server.real_tiny_server import serving
from tests.server.server_harness import quiet_args, recording_engine, running_server
from tests.support.fake_model import FakeModel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MODEL = BUNDLED_MODEL_NAME
COMPACT = {"guided_whitespace_pattern": ""}  # compact JSON: no free whitespace to wander in
SMALL_STR = {"type": "string", "maxLength": 12}

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": SMALL_STR,
            "address": {"type": "object", "properties": {"city": SMALL_STR, "zip": {
                "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
            "required": ["name", "address"]}},
        "required": ["user"]},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"]},
    "array_bounds": {"type": "object", "properties": {"scores": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 2, "maxItems": 3}}, "required": ["scores"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "optional_fields": {"type": "object", "properties": {"title": SMALL_STR, "year": {
        "type": "integer", "minimum": 1900, "maximum": 2100}, "note": SMALL_STR}, "required": ["title"]},
    "array_of_objects": {"type": "object", "properties": {"pets": {"type": "array", "minItems": 1, "maxItems": 2,
                                                                   "items": {"type": "object", "properties": {
                                                                       "name": SMALL_STR, "legs": {
                                                                           "type": "integer", "minimum": 0,
                                                                           "maximum": 8}},
                                                                       "required": ["name", "legs"]}}},
                         "required": ["pets"]},
    "booleans": {"type": "object", "properties": {"done": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}}, "required": ["done", "tags"]},
    "closed": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                "ok": {"type": "boolean"}},
               "required": ["id", "ok"], "additionalProperties": False},
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": SMALL_STR, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": SMALL_STR}, "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
# greedy SmolLM2 makes one call and stops here (asked for two things it keeps calling until max_tokens)
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server_url():
    args = quiet_args(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with serving("", args, max_model_len=1024, num_gpu_blocks_override=512, max_num_seqs=16, dtype="auto") as (_, address):
        yield address.url


@pytest.fixture(scope="module")
def client(server_url):
    with openai.OpenAI(base_url=f"{server_url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def _chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 96)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# -- structured outputs ------------------------------------------------------------------------------------


class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["France", "Japan", "Peru"]
    population_millions: int = Field(ge=0, le=40)


def test_sdk_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=80, temperature=0, extra_body=COMPACT)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)
    assert choice.message.parsed == City.model_validate_json(choice.message.content)


def test_json_schemas_validate_and_almost_all_stop(client):
    def ask(item):
        name, schema = item
        return _chat(client, f"Give an example {name.replace('_', ' ')} JSON object.", max_tokens=120,
                     response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
                     extra_body=COMPACT).choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = list(pool.map(ask, SCHEMAS.items()))
    stopped = 0
    for (name, schema), choice in zip(SCHEMAS.items(), choices, strict=True):
        if choice.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert stopped >= 0.95 * len(SCHEMAS), [c.message.content for c in choices]


def test_guided_choice_regex_and_json_object(client):
    colours = ["red", "green", "blue"]
    picks = _chat(client, "Pick a colour.", n=4, temperature=1.0, seed=7, max_tokens=8,
                  extra_body={"guided_choice": colours})
    assert all(c.message.content in colours and c.finish_reason == "stop" for c in picks.choices)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    r = _chat(client, "A phone number:", max_tokens=20, extra_body={"guided_regex": phone})
    assert re.fullmatch(phone, r.choices[0].message.content)
    # structured_outputs (vLLM's newer spelling) carries the same specs
    r = _chat(client, "Yes or no?", max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    r = _chat(client, "Any JSON object.", max_tokens=60, response_format={"type": "json_object"}, extra_body=COMPACT)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_endpoint_with_guided_json(client):
    schema = SCHEMAS["enums"]
    r = client.completions.create(model=MODEL, prompt="A T-shirt as JSON:", max_tokens=40, temperature=0,
                                  extra_body={"guided_json": schema, **COMPACT})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), schema)


@pytest.mark.parametrize(("field", "value"), [("guided_json", {"type": "no-such-type"}),
                                              ("guided_regex", "(unclosed"),
                                              ("guided_grammar", "root ::= undefined_rule")])
def test_a_spec_that_does_not_compile_is_a_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, "x", max_tokens=4, extra_body={field: value})
    assert err.value.param == field, err.value.body


# -- tool calls --------------------------------------------------------------------------------------------


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_tool_choice_yields_calls_whose_arguments_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))


def _streamed_calls(stream) -> tuple[dict[int, dict], str | None]:
    """Reassembles streamed tool-call deltas as OpenAI streams them: index, id, type and name once,
    then argument fragments."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and (tc.function is None or tc.function.name is None), tc
                calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return calls, finish


@pytest.mark.parametrize("parallel", [True, False])
def test_streamed_tool_calls_equal_the_non_streamed_ones(client, parallel):
    kw = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 64,
          "temperature": 0, "parallel_tool_calls": parallel}
    full = client.chat.completions.create(**kw).choices[0]
    calls, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in full.message.tool_calls]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == expected
    assert expected and finish == full.finish_reason == "tool_calls"
    if not parallel:
        assert len(expected) == 1


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=60, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), _schema_of("get_time"))


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content


# -- LangChain ---------------------------------------------------------------------------------------------


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=12, description="the pet's name")
    kind: Literal["cat", "dog", "bird"]


class get_weather(BaseModel):  # LangChain names the tool after the class
    """Current weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture
def chat_model(server_url, no_network):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{server_url}/v1", api_key="x", model=MODEL, temperature=0, max_tokens=64,
                      max_retries=0, timeout=120, extra_body=COMPACT)


@pytest.fixture
def no_network(monkeypatch):
    """Only loopback connections: a download attempt (tiktoken's encodings) fails loudly, not slowly."""
    real_connect = socket.socket.connect

    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if host not in ("127.0.0.1", "::1", "localhost") and self.family != socket.AF_UNIX:
            raise AssertionError(f"test tried to reach the network: {address}")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)


def test_with_structured_output_returns_the_model(chat_model):
    pet = chat_model.with_structured_output(Pet, method="json_schema").invoke("Describe a pet as JSON.")
    assert isinstance(pet, Pet)


def test_bind_tools_with_a_forced_call(chat_model):
    bound = chat_model.bind_tools([get_weather], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    get_weather.model_validate(call["args"])
    assert call["id"]


# -- reasoning (fake model scripted to think out loud) ------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_client(model_folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    fake = FakeModel.for_folder(model_folder)
    fake.script = tokenizer.encode("<think>the sky is blue</think>blue", add_special_tokens=False) + [
        tokenizer.eos_token_id]
    args = quiet_args(reasoning_parser="deepseek_r1", enable_reasoning=True)
    with running_server(lambda: recording_engine(model_folder, fake), args) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as c:
        yield c


def test_reasoning_content_is_split_from_content(thinking_client):
    r = thinking_client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "sky?"}],
                                                max_tokens=64)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.reasoning_content == "the sky is blue"
    assert message.content == "blue"


def test_reasoning_streams_as_reasoning_deltas_then_content(thinking_client):
    stream = thinking_client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "sky?"}],
                                                     max_tokens=64, stream=True)
    reasoning, content, order = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
                order.append("r")
            if delta.get("content"):
                content.append(delta["content"])
                order.append("c")
    assert "".join(reasoning) == "the sky is blue" and "".join(content) == "blue"
    assert order == sorted(order, reverse=True)  # every reasoning delta comes before any content
