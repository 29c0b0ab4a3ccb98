"""InputProcessor: the model-dependent intake checks (each names its field), truncation, and the fan-out
of n / best_of samples into scheduler requests."""

from __future__ import annotations

import json

import pytest

from aserve.config import EngineArgs
from aserve.engine.input_processor import InputProcessor
from aserve.sampling_params import SamplingParams, SamplingParamsError

VOCAB = 100
MAX_MODEL_LEN = 32
MAX_LOGPROBS = 5


class CharTokenizer:
    """One token per character (ord % VOCAB): enough to test intake without a real tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]


def _config(tmp_path, **engine_args):
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "float32", "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = {"max_model_len": MAX_MODEL_LEN, "max_logprobs": MAX_LOGPROBS, "dtype": "float32", **engine_args}
    return EngineArgs(model=str(tmp_path), **args).create_config()


@pytest.fixture
def intake(tmp_path) -> InputProcessor:
    return InputProcessor(_config(tmp_path), CharTokenizer(), (2,))


def _field(fn) -> tuple[str, str]:
    with pytest.raises(SamplingParamsError) as info:
        fn()
    return info.value.field, info.value.code


@pytest.mark.parametrize("params, field", [
    (SamplingParams(top_k=VOCAB + 1), "top_k"),
    (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (SamplingParams(allowed_token_ids=[0, VOCAB]), "allowed_token_ids"),
    (SamplingParams(allowed_token_ids=list(range(VOCAB)) + [0]), "allowed_token_ids"),  # longer than the vocab
    (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (SamplingParams(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    (SamplingParams(truncate_prompt_tokens=MAX_MODEL_LEN + 1), "truncate_prompt_tokens"),
    (SamplingParams(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    (SamplingParams(logits_processors=[lambda ids, logits: logits]), None),  # fine in-process
])
def test_model_dependent_checks_name_the_field(intake, params, field):
    run = lambda: intake.process_prompt(None, [1, 2, 3], params)  # noqa: E731
    if field is None:
        assert run() == [1, 2, 3]
    else:
        assert _field(run)[0] == field


def test_the_edges_pass(intake):
    params = SamplingParams(top_k=VOCAB, stop_token_ids=[VOCAB - 1], allowed_token_ids=list(range(VOCAB)),
                            logit_bias={VOCAB - 1: 1.0}, logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS,
                            truncate_prompt_tokens=MAX_MODEL_LEN, max_tokens=MAX_MODEL_LEN - 3)
    assert intake.process_prompt(None, [1, 2, 3], params) == [1, 2, 3]


@pytest.mark.parametrize("ids, code", [
    ([], "invalid_value"),
    ([VOCAB], "invalid_value"),
    ([-1], "invalid_value"),
    ([2**70], "invalid_value"),
    ([True], "invalid_value"),
    (["1"], "invalid_value"),
    (list(range(MAX_MODEL_LEN)), "context_length_exceeded"),
    ([0] * 10**6, "context_length_exceeded"),
])
def test_bad_prompts_are_refused(intake, ids, code):
    assert _field(lambda: intake.process_prompt(None, ids, SamplingParams(max_tokens=1))) == ("prompt", code)


def test_prompt_length_cap_and_max_tokens(intake):
    longest = [1] * (MAX_MODEL_LEN - 1)
    assert intake.process_prompt(None, longest, SamplingParams(max_tokens=1)) == longest
    assert intake.process_prompt(None, longest, SamplingParams(max_tokens=None)) == longest
    assert _field(lambda: intake.process_prompt(None, longest, SamplingParams(max_tokens=2))) == \
        ("max_tokens", "context_length_exceeded")


def test_truncation_keeps_the_last_tokens_before_the_length_check(intake):
    ids = list(range(3, 3 + 60))
    assert intake.process_prompt(None, ids, SamplingParams(truncate_prompt_tokens=4, max_tokens=1)) == ids[-4:]


def test_text_prompts_are_tokenized(intake):
    assert intake.process_prompt("ab", None, SamplingParams(max_tokens=1)) == [ord("a") % VOCAB, ord("b") % VOCAB]
    assert _field(lambda: intake.process_prompt(None, None, SamplingParams())) == ("prompt", "invalid_value")


def test_without_a_tokenizer_text_and_stop_strings_are_refused(tmp_path):
    intake = InputProcessor(_config(tmp_path, skip_tokenizer_init=True), None, (2,))
    assert _field(lambda: intake.process_prompt("hi", None, SamplingParams(max_tokens=1)))[0] == "prompt"
    assert _field(lambda: intake.process_prompt(None, [1], SamplingParams(stop=["x"], max_tokens=1)))[0] == "stop"
    assert intake.process_prompt(None, [1], SamplingParams(max_tokens=1)) == [1]


def test_logits_processors_need_the_in_process_executor(tmp_path):
    intake = InputProcessor(_config(tmp_path, distributed_executor_backend="mp"), CharTokenizer(), (2,))
    params = SamplingParams(logits_processors=[lambda ids, logits: logits])
    assert _field(lambda: intake.process_prompt(None, [1], params))[0] == "logits_processors"


def test_samples_fan_out_with_derived_seeds_and_shared_prompt(intake):
    params = SamplingParams(n=2, best_of=3, seed=7, max_tokens=4)
    requests = intake.make_requests(["r#0", "r#1", "r#2"], [1, 2, 3], params, arrival_time=0.0, priority=0)
    assert [r.request_id for r in requests] == ["r#0", "r#1", "r#2"]
    assert [r.sampling_params.seed for r in requests] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 and r.sampling_params.best_of is None for r in requests)
    # best_of ranks by cumulative logprob, so each sample reports its sampled logprob.
    assert all(r.sampling_params.logprobs == 0 for r in requests)
    assert [r.wait_for_req_id for r in requests] == [None, "r#0", "r#0"]


def test_derived_seeds_stay_in_int64(intake):
    top = SamplingParams(n=3, seed=2**63 - 1, max_tokens=1)
    requests = intake.make_requests(["a", "b", "c"], [1], top, arrival_time=0.0, priority=0)
    assert [r.sampling_params.seed for r in requests] == [2**63 - 1, -(2**63), -(2**63) + 1]


def test_one_sample_keeps_its_params(intake):
    params = SamplingParams(seed=7, max_tokens=4)
    (request,) = intake.make_requests(["r"], [1, 2], params, arrival_time=0.0, priority=0)
    assert request.sampling_params is params and request.wait_for_req_id is None
