"""Output processing: stop strings across tokens, delta streaming with hold-back, n / best_of, logprobs."""

from __future__ import annotations

import pytest

from aserve.core.batch import EngineCoreOutput, TokenLogprobs
from aserve.engine.output_processor import OutputProcessor
from aserve.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    return smol_tokenizer


def _feed(proc, req_id, token_ids, finish_last=None):
    """Feeds tokens one per step; returns the RequestOutputs and the ids to finish per step."""
    outs, finishes = [], []
    for i, t in enumerate(token_ids):
        last = i == len(token_ids) - 1
        eo = EngineCoreOutput(req_id=req_id, new_token_ids=[t], finish_reason=finish_last if last else None)
        processed = proc.process_outputs([eo])
        outs += processed.request_outputs
        finishes += processed.reqs_to_finish
    return outs, finishes


def test_stop_string_spanning_tokens_is_cut(tokenizer):
    text = "Hello world. The answer is STOP and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["answer is STOP"], max_tokens=50, output_kind=RequestOutputKind.DELTA)
    proc.add_request("r", None, [1, 2], params, False, 0.0)
    outs, finishes = _feed(proc, "r", ids)
    assert finishes == ["r"]
    streamed = "".join(o.outputs[0].text for o in outs if o.outputs)
    assert streamed == "Hello world. The "
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "answer is STOP"
    # no partial stop string ever left the processor
    assert all("answer is" not in o.outputs[0].text for o in outs if o.outputs)


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(stop=["three"], include_stop_str_in_output=True, max_tokens=50)
    proc.add_request("r", None, [1], params, False, 0.0)
    outs, _ = _feed(proc, "r", ids)
    assert outs[-1].outputs[0].text == "one two three"


def test_delta_concatenation_equals_cumulative(tokenizer):
    text = "Ünïcödé ✓ 你好, emoji 🎉 done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tokenizer)
    proc.add_request("d", None, [1], SamplingParams(output_kind=RequestOutputKind.DELTA), False, 0.0)
    proc.add_request("c", None, [1], SamplingParams(), False, 0.0)
    deltas, _ = _feed(proc, "d", ids, finish_last="length")
    cumul, _ = _feed(proc, "c", ids, finish_last="length")
    assert "".join(o.outputs[0].text for o in deltas if o.outputs) == cumul[-1].outputs[0].text
    assert cumul[-1].outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    assert cumul[-1].outputs[0].token_ids == ids


def test_n_samples_and_best_of(tokenizer):
    proc = OutputProcessor(tokenizer)
    params = SamplingParams(n=1, best_of=3, max_tokens=2, temperature=1.0, logprobs=0)
    sample_ids = proc.add_request("b", None, [1], params, False, 0.0)
    assert len(sample_ids) == 3
    lps = {sample_ids[0]: -3.0, sample_ids[1]: -0.5, sample_ids[2]: -2.0}
    outs = []
    for sid in sample_ids:
        eo = EngineCoreOutput(req_id=sid, new_token_ids=[100], finish_reason="length",
                              new_logprobs=[TokenLogprobs([100], [lps[sid]], [1])])
        outs += proc.process_outputs([eo]).request_outputs
    assert len(outs) == 1 and outs[0].finished  # best_of reports once, at the end
    assert len(outs[0].outputs) == 1 and outs[0].outputs[0].index == 0


def test_logprobs_are_decoded(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode(" hello", add_special_tokens=False)
    proc.add_request("l", None, [1], SamplingParams(logprobs=1, max_tokens=1), True, 0.0)
    eo = EngineCoreOutput(req_id="l", new_token_ids=ids[:1], finish_reason="length",
                          new_logprobs=[TokenLogprobs([ids[0], 5], [-0.1, -0.05], [2, 1])])
    out = proc.process_outputs([eo]).request_outputs[-1]
    lp = out.outputs[0].logprobs[0]
    assert lp[ids[0]].rank == 2 and lp[ids[0]].decoded_token == " hello"
    assert lp[5].rank == 1
    assert out.outputs[0].cumulative_logprob == pytest.approx(-0.1)


def test_abort_returns_final_output(tokenizer):
    proc = OutputProcessor(tokenizer)
    proc.add_request("a", None, [1], SamplingParams(n=2), False, 0.0)
    out = proc.abort_request("a")
    assert out.finished and {c.finish_reason for c in out.outputs} == {"abort"}
    assert not proc.has_request("a")
