"""LLMEngine (the synchronous engine the offline LLM drives) over a fake model: intake validation,
step outputs, abort, and a request failed by the runner ending alone with finish_reason "error"."""

from __future__ import annotations

import pytest

from aserve.engine.llm_engine import LLMEngine
from aserve.sampling_params import SamplingParams, SamplingParamsError
from tests.support.fake_model import FakeModel, build_model_folder, engine_args, fake_executor_factory

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return build_model_folder(tmp_path_factory.mktemp("fake_model"))


@pytest.fixture
def model(folder) -> FakeModel:
    return FakeModel.for_folder(folder)


@pytest.fixture
def engine(folder, model) -> LLMEngine:
    engine = LLMEngine.from_engine_args(engine_args(folder, max_model_len=64),
                                        executor_factory=fake_executor_factory(model))
    yield engine
    engine.shutdown()


def run_to_completion(engine: LLMEngine, max_steps: int = 200) -> dict:
    """Steps until nothing is left; returns each request's last output."""
    last = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return last
        for out in engine.step():
            last[out.request_id] = out
    raise AssertionError(f"not finished after {max_steps} steps")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt_token_ids": [5, 600000]}, "prompt"),          # a token id outside the vocabulary
    ({"prompt_token_ids": list(range(10, 80))}, "prompt"),  # 70 tokens >= max_model_len 64
    ({"prompt_token_ids": [5, 6], "params": SamplingParams(max_tokens=63)}, "max_tokens"),
    ({"prompt_token_ids": [5, 6], "priority": 3}, "priority"),  # needs --scheduling-policy priority
    ({"prompt_token_ids": []}, "prompt"),
])
def test_add_request_rejects_bad_input_naming_the_field(engine, kwargs, field):
    params = kwargs.pop("params", GREEDY)
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("r", None, params, **kwargs)
    assert info.value.field == field
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected_while_running(engine):
    engine.add_request("r", "hello world", GREEDY)
    with pytest.raises(SamplingParamsError) as info:
        engine.add_request("r", "again", GREEDY)
    assert info.value.field == "request_id"
    run_to_completion(engine)
    engine.add_request("r", "again", GREEDY)  # a finished id may be reused


def test_step_produces_the_model_tokens_and_text(engine, model):
    prompt_ids = engine.add_request("a", "the quick brown fox", GREEDY)
    assert prompt_ids == engine.tokenizer.encode("the quick brown fox")
    last = run_to_completion(engine)
    out = last["a"]
    expected = model.expected_token_ids(prompt_ids, GREEDY)
    assert out.finished and out.prompt_token_ids == prompt_ids
    assert out.outputs[0].token_ids == expected
    assert out.outputs[0].text == engine.tokenizer.decode(expected)
    assert out.outputs[0].finish_reason == "length" and out.error is None


def test_abort_frees_blocks_and_reports_abort(engine):
    engine.add_request("long", None, SamplingParams(temperature=0, max_tokens=40), prompt_token_ids=list(range(5, 25)))
    engine.step()
    engine.step()
    assert engine.core.current_stats().num_used_blocks > 0
    final = engine.abort_request("long")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.core.current_stats().num_used_blocks == 0
    assert not engine.has_unfinished_requests()
    assert engine.abort_request("long") is None  # unknown now: nothing to do


def test_a_request_failed_by_the_runner_ends_alone_with_error(engine, model):
    model.fail_if = lambda req_id, prompt: "logits processor raised" if req_id == "bad" else None
    good_ids = engine.add_request("good", "red green blue", GREEDY)
    engine.add_request("bad", "one two three", GREEDY)
    last = run_to_completion(engine)
    bad, good = last["bad"], last["good"]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert bad.error is not None and "logits processor raised" in bad.error.message
    assert good.error is None and good.outputs[0].finish_reason == "length"
    assert good.outputs[0].token_ids == model.expected_token_ids(good_ids, GREEDY)
    assert engine.core.current_stats().num_used_blocks == 0
