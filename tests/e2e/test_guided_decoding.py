"""Structured outputs through the offline API on the bundled SmolLM2: grammar-constrained outputs
validate, intake refuses specs that do not compile, the runner fails a request alone when its
grammar cannot be built, and preemption / n > 1 / min_tokens / the mp executor keep outputs valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from aserve import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from aserve.core.batch import NewRequestData, SchedulerOutput
from aserve.sampling_params import SamplingParamsError

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


def _json_params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 56)
    return SamplingParams(guided_decoding=GuidedDecodingParams(json=PERSON, disable_any_whitespace=True), **kw)


@pytest.fixture(scope="module")
def llm_and_runner(bundled_model_path):
    """One LLM (and its in-process runner) for the module: building one costs seconds on CPU. Prefix
    caching is off so that the test that drives the runner directly leaves no reusable KV behind."""
    from aserve import LLM
    from aserve.config import EngineArgs
    from aserve.engine.llm_engine import LLMEngine
    from aserve.executor.thread import ThreadExecutor

    executors = []

    def factory(config):
        executors.append(ThreadExecutor(config))
        return executors[0]

    args = EngineArgs.from_kwargs(model="", dtype="float32", max_model_len=256, cpu_kvcache_space=0.05,
                                  max_num_seqs=16, enable_prefix_caching=False)
    llm = LLM.from_engine(LLMEngine.from_engine_args(args, executor_factory=factory))
    return llm, executors[0].runner


@pytest.fixture(scope="module")
def llm(llm_and_runner):
    return llm_and_runner[0]


def test_json_choice_regex_outputs_follow_their_grammar(llm):
    outs = llm.generate(
        ["A person as JSON:", "Pick a colour:", "A phone number:"],
        [_json_params(temperature=0.8, seed=3, n=2),
         SamplingParams(max_tokens=6, temperature=1.0, n=3,
                        structured_outputs=StructuredOutputsParams(choice=["red", "green", "blue"])),
         SamplingParams(max_tokens=16, guided_decoding=GuidedDecodingParams(regex=r"\(\d{3}\) \d{3}-\d{4}"))],
        use_tqdm=False)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    assert {c.text for c in outs[1].outputs} <= {"red", "green", "blue"}
    assert all(c.finish_reason == "stop" for c in outs[1].outputs)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[2].outputs[0].text)


def test_min_tokens_yields_to_a_completed_grammar(llm):
    """min_tokens masks EOS, but once the grammar is complete only EOS is allowed: the grammar wins."""
    params = SamplingParams(max_tokens=6, min_tokens=4, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    (out,) = llm.generate(["Yes or no?"], params, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    assert out.outputs[0].finish_reason == "stop"


def test_a_spec_that_does_not_compile_is_refused_at_intake_naming_the_field(llm):
    bad = SamplingParams(guided_decoding=GuidedDecodingParams(regex="(unclosed"))
    with pytest.raises(SamplingParamsError) as err:
        llm.generate(["x"], bad, use_tqdm=False)
    assert err.value.field == "guided_regex"
    bad_schema = SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "no-such-type"}))
    with pytest.raises(SamplingParamsError) as err:
        llm.generate(["x"], bad_schema, use_tqdm=False)
    assert err.value.field == "guided_json"


def test_preemption_rebuilds_grammar_state_and_gives_the_same_outputs(llm, llm_with_runner, stat_totals):
    """Greedy guided outputs are the same with a KV pool so small that requests get preempted (their
    grammar state is rebuilt by replaying their outputs) as with plenty of room (the module's LLM)."""
    prompts = ["Ann as JSON:", "Bob as JSON:"]
    params = _json_params(max_tokens=16, temperature=0.0)
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    # two requests needing 3 blocks of 8 each by the end, 4 usable blocks (block 0 is reserved): one of
    # them must be preempted
    tight, _ = llm_with_runner("", dtype="float32", max_model_len=32, num_gpu_blocks_override=5,
                               block_size=8, enable_prefix_caching=True)
    totals = stat_totals(tight)
    got = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert totals.num_preemptions > 0
    assert got == expected
    assert all(text.startswith('{"name": "') for text in got), got  # compact: fixed separators


def test_runner_fails_only_the_request_whose_grammar_cannot_be_built(llm_and_runner):
    """Bypassing intake: the runner reports the request in failed_requests and serves the other one."""
    _, runner = llm_and_runner
    good = SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(choice=["ok"]))
    bad = msgspec_replace(good, guided_decoding=GuidedDecodingParams(regex="(unclosed"))
    prompt = [1, 2, 3]
    new = [NewRequestData("good", prompt, [], good, [1], 0, [2]), NewRequestData("bad", prompt, [], bad, [2], 0, [2])]
    out = runner.execute(SchedulerOutput(new, [], ["good", "bad"], [3, 3], []))
    assert out.req_ids == ["good"] and "guided_regex" in out.failed_requests["bad"]
    assert "bad" not in runner.states and "bad" not in runner.structured.requests
    runner.execute(SchedulerOutput([], [], [], [], ["good"]))  # leave the shared runner as we found it
    assert "good" not in runner.states


def msgspec_replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)


def test_mp_executor_carries_the_spec_to_the_worker(bundled_model_path):
    from aserve import LLM

    llm = LLM("", dtype="float32", max_model_len=64, cpu_kvcache_space=0.02, max_num_seqs=4,
              distributed_executor_backend="mp")
    try:
        (out,) = llm.generate(["Pick:"], SamplingParams(max_tokens=4, n=2, temperature=1.0, guided_decoding=(
            GuidedDecodingParams(choice=["alpha", "beta"]))), use_tqdm=False)
        assert {c.text for c in out.outputs} <= {"alpha", "beta"}
    finally:
        llm.llm_engine.shutdown()
