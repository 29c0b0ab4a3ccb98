"""Packing a mixed step: decodes first, positions, slot mapping, sampling rows, prompt-logprob spans."""

from __future__ import annotations

import torch

from aserve.runner.input_batch import CachedRequestState, advance_decode_inputs, build_model_inputs
from aserve.runner.sampling import SamplingStates
from aserve.sampling_params import SamplingParams


def _state(req_id, prompt, outputs, blocks, computed, **params):
    sp = SamplingParams(**params)
    token_ids = prompt + outputs
    sampling = SamplingStates(1000, "cpu").add(sp, token_ids, len(prompt), [])
    return CachedRequestState(req_id=req_id, token_ids=token_ids, num_prompt_tokens=len(prompt), params=sp,
                              block_ids=blocks, num_computed_tokens=computed, sampling=sampling)


def test_mixed_batch_packing():
    bs = 4
    states = {
        "prefill": _state("prefill", list(range(10, 20)), [], [7, 3, 9], 4, prompt_logprobs=1),  # chunk 4..9
        "decode": _state("decode", [1, 2, 3, 4, 5], [6], [5, 2], 5),  # decodes token at position 5
    }
    inputs = build_model_inputs(states, ["prefill", "decode"], [6, 1], bs, torch.device("cpu"))
    assert inputs.req_ids == ["decode", "prefill"]  # decodes first
    assert inputs.meta.num_decodes == 1
    assert inputs.input_ids.tolist() == [6] + list(range(14, 20))
    assert inputs.positions.tolist() == [5, 4, 5, 6, 7, 8, 9]
    # position 5 of "decode": block_ids[1]=2 -> slot 2*4+1; "prefill" positions 4..9 -> blocks 3 (4..7), 9 (8, 9)
    assert inputs.meta.slot_mapping.tolist() == [9, 12, 13, 14, 15, 36, 37]
    assert inputs.meta.seq_lens_cpu == [6, 10]
    assert inputs.meta.query_start_loc_cpu == [0, 1, 7]
    assert inputs.meta.block_tables.tolist() == [[5, 2, 0], [7, 3, 9]]
    assert inputs.sample_req_ids == ["decode", "prefill"]
    assert inputs.logits_indices == [0, 6]
    # prompt logprobs for positions 4..8 score prompt tokens 5..9 (position 9 has no next prompt token)
    assert inputs.prompt_logprob_spans == {"prefill": (1, 5, 5)}


def test_partial_prefill_does_not_sample():
    states = {"p": _state("p", list(range(20)), [], [1, 2, 3, 4, 5], 0)}
    inputs = build_model_inputs(states, ["p"], [8], 4, torch.device("cpu"))
    assert inputs.sample_req_ids == [] and inputs.logits_indices == []


def test_padding_to_static_size():
    states = {f"r{i}": _state(f"r{i}", [1, 2, 3], [4], [i + 1], 3) for i in range(3)}
    inputs = build_model_inputs(states, list(states), [1, 1, 1], 4, torch.device("cpu"), pad_to_num_seqs=4)
    assert inputs.meta.num_seqs == 4 and inputs.input_ids.shape[0] == 4
    assert inputs.meta.slot_mapping.tolist()[-1] == -1  # the padded row writes nowhere
    assert inputs.sample_req_ids == ["r0", "r1", "r2"]  # and is never sampled


def test_advancing_decode_inputs_in_place_equals_rebuilding_them():
    """Multi-step decode's in-place advance (block boundaries crossed, padded rows kept) equals a fresh pack."""
    bs = 4
    states = {"a": _state("a", [1, 2, 3], [4], [5, 8], 3), "b": _state("b", [9, 8, 7, 6, 5, 4, 3], [2], [1, 2, 6], 7),
              "c": _state("c", [1], [2], [3, 4], 1)}
    ids = list(states)
    inputs = build_model_inputs(states, ids, [1, 1, 1], bs, torch.device("cpu"), pad_to_num_seqs=4)
    for step, next_tokens in enumerate(([11, 12, 13], [21, 22, 23], [31, 32, 33])):
        for req_id, token in zip(ids, next_tokens):
            states[req_id].token_ids.append(token)
            states[req_id].num_computed_tokens += 1
        inputs = advance_decode_inputs(inputs, next_tokens, bs)
        fresh = build_model_inputs(states, ids, [1, 1, 1], bs, torch.device("cpu"), pad_to_num_seqs=4)
        for name in ("input_ids", "positions"):
            assert torch.equal(getattr(inputs, name), getattr(fresh, name)), (step, name)
        for name in ("slot_mapping", "seq_lens", "block_tables", "query_start_loc"):
            assert torch.equal(getattr(inputs.meta, name), getattr(fresh.meta, name)), (step, name)
        assert inputs.meta.seq_lens_cpu == fresh.meta.seq_lens_cpu
        assert inputs.meta.max_seq_len == fresh.meta.max_seq_len
        assert inputs.logits_indices == fresh.logits_indices and inputs.sample_req_ids == fresh.sample_req_ids
