"""StepSampler (runner/step_sampling.py): one token per request, or the verification of its drafts.

Hand-made logits rows (1 + drafts per request) through a real `Sampler` and a `StructuredOutputs`
without guided requests: greedy acceptance (the batched argmax path and the sequential one), the
history each position sees (penalties, min_tokens), seeded requests drawing exactly the tokens they
draw without drafts, typical acceptance, logprobs per output token.
"""

from __future__ import annotations

import math

import pytest
import torch

from aserve.runner.input_batch import CachedRequestState
from aserve.runner.sampling import Sampler
from aserve.runner.step_sampling import StepSampler, TypicalAcceptance
from aserve.runner.structured import StructuredOutputs
from aserve.sampling_params import SamplingParams

VOCAB = 16
EOS = 2


def make_state(sampler: Sampler, req_id: str, params: SamplingParams, prompt=(0, 1), outputs=(),
               stop_ids=(EOS,)) -> CachedRequestState:
    """A live request as the runner holds it (its sampling state reads the same token list)."""
    tokens = list(prompt) + list(outputs)
    sampling = sampler.states.add(params, tokens, len(prompt), list(stop_ids))
    return CachedRequestState(req_id=req_id, token_ids=tokens, num_prompt_tokens=len(prompt), params=params,
                              block_ids=[1], num_computed_tokens=len(tokens) - 1, sampling=sampling)


def step_sampler(sampler: Sampler, typical: TypicalAcceptance | None = None) -> StepSampler:
    return StepSampler(sampler, StructuredOutputs(None, max_num_rows=64), typical)


def peaked_rows(argmaxes: list[int], top: float = 8.0, second: int | None = None) -> torch.Tensor:
    """One row per entry: that token at `top`, everything else at 0 (token `second`, if given, at top - 1)."""
    rows = torch.zeros(len(argmaxes), VOCAB)
    for i, t in enumerate(argmaxes):
        rows[i, t] = top
        if second is not None and second != t:
            rows[i, second] = top - 1
    return rows


GREEDY = SamplingParams(temperature=0.0)


# -- greedy acceptance -------------------------------------------------------------------------------
@pytest.mark.parametrize("sequential", [False, True], ids=["batched_argmax", "sequential"])
@pytest.mark.parametrize("drafts, expected, rejected", [
    ([5, 7], [5, 7, 9], 0),  # every draft accepted, plus the bonus token of the last row
    ([5, 8], [5, 7], 1),  # the second draft differs: the target's own token there, then stop
    ([4, 7], [5], 2),  # the first draft differs: one token, both drafts rejected
])
def test_greedy_acceptance(sequential, drafts, expected, rejected):
    s = Sampler(VOCAB, "cpu")
    # logprobs=None vs 0 picks the path: a request asking for logprobs cannot take the batched argmax.
    params = SamplingParams(temperature=0.0, logprobs=0 if sequential else None)
    state = make_state(s, "r", params)
    before = list(state.token_ids)
    out = step_sampler(s).sample(peaked_rows([5, 7, 9]), ["r"], {"r": state}, {"r": drafts}, None)
    assert out.req_ids == ["r"]
    assert out.token_ids == [expected]
    assert out.num_rejected == {"r": rejected}
    assert state.token_ids == before + expected  # appended to the runner's (and the sampler's) list
    assert state.sampling.num_output_tokens == len(expected)
    assert not out.failed


def test_greedy_batch_mixes_requests_with_and_without_drafts():
    s = Sampler(VOCAB, "cpu")
    states = {r: make_state(s, r, GREEDY) for r in ("a", "b", "c")}
    # rows: a (2 drafts) -> 3 rows, b (no drafts) -> 1 row, c (1 draft) -> 2 rows
    logits = peaked_rows([3, 4, 6, 11, 12, 13])
    out = step_sampler(s).sample(logits, ["a", "b", "c"], states, {"a": [3, 4], "c": [1]}, None)
    assert out.req_ids == ["a", "b", "c"]
    assert out.token_ids == [[3, 4, 6], [11], [12]]
    assert out.num_rejected == {"a": 0, "b": 0, "c": 1}


def test_no_drafts_samples_one_token_per_row():
    s = Sampler(VOCAB, "cpu")
    states = {r: make_state(s, r, GREEDY) for r in ("a", "b")}
    out = step_sampler(s).sample(peaked_rows([7, 8]), ["a", "b"], states, {}, None)
    assert out.token_ids == [[7], [8]] and out.num_rejected == {}
    assert states["a"].token_ids[-1] == 7 and states["b"].token_ids[-1] == 8


@pytest.mark.parametrize("sequential", [False, True], ids=["batched_argmax", "sequential"])
def test_an_accepted_eos_draft_ends_verification(sequential):
    """The target agrees with an EOS draft: the request is done, nothing after EOS is verified."""
    s = Sampler(VOCAB, "cpu")
    state = make_state(s, "r", SamplingParams(temperature=0.0, logprobs=0 if sequential else None))
    out = step_sampler(s).sample(peaked_rows([EOS, 7, 9]), ["r"], {"r": state}, {"r": [EOS, 7]}, None)
    assert out.token_ids == [[EOS]]
    assert out.num_rejected == {"r": 2}
    assert state.token_ids[-1] == EOS


# -- the sequential path: each position sees the accepted drafts as history -------------------------
def test_repetition_penalty_sees_accepted_drafts():
    """Row 1 prefers token 3 (4.0) over 4 (3.0), but 3 was just accepted at position 0: a repetition
    penalty of 2 halves it to 2.0, so the target's token at position 1 is 4 and the draft 3 is rejected."""
    s = Sampler(VOCAB, "cpu")
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    state = make_state(s, "r", params, prompt=(0, 1))
    logits = torch.zeros(3, VOCAB)
    logits[0, 3] = 5.0
    logits[1, 3], logits[1, 4] = 4.0, 3.0
    logits[2, 5] = 5.0
    out = step_sampler(s).sample(logits, ["r"], {"r": state}, {"r": [3, 3]}, None)
    assert out.token_ids == [[3, 4]] and out.num_rejected == {"r": 1}

    # The same rows one step at a time without drafts give the same tokens.
    s2 = Sampler(VOCAB, "cpu")
    ref = make_state(s2, "r", params, prompt=(0, 1))
    for i in range(2):
        tok = s2.sample(logits[i:i + 1], [ref.sampling]).sampled_token_ids[0]
        ref.token_ids.append(tok)
    assert ref.token_ids == state.token_ids


def test_min_tokens_counts_accepted_drafts():
    """EOS is the argmax of every row; min_tokens=2 masks it for outputs 0 and 1 only, so position 2
    (after two accepted drafts) may end the request."""
    s = Sampler(VOCAB, "cpu")
    params = SamplingParams(temperature=0.0, min_tokens=2)
    state = make_state(s, "r", params)
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 9.0
    logits[0, 3] = logits[1, 4] = logits[2, 5] = 8.0
    out = step_sampler(s).sample(logits, ["r"], {"r": state}, {"r": [3, 4]}, None)
    assert out.token_ids == [[3, 4, EOS]]
    assert out.num_rejected == {"r": 0}


def test_min_tokens_rejects_eos_draft_while_masked():
    s = Sampler(VOCAB, "cpu")
    state = make_state(s, "r", SamplingParams(temperature=0.0, min_tokens=3))
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 9.0
    logits[:, 6] = 8.0
    out = step_sampler(s).sample(logits, ["r"], {"r": state}, {"r": [EOS, EOS]}, None)
    assert out.token_ids == [[6]] and out.num_rejected == {"r": 2}


def test_sequential_batch_keeps_requests_apart():
    """Two history-dependent requests in one verify: each one's penalty sees only its own tokens."""
    s = Sampler(VOCAB, "cpu")
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    a = make_state(s, "a", params, prompt=(0,))
    b = make_state(s, "b", params, prompt=(0,))
    logits = torch.zeros(6, VOCAB)
    logits[0, 3] = 5.0  # a, pos 0 -> 3 (draft 3 accepted)
    logits[1, 3], logits[1, 4] = 4.0, 2.5  # a, pos 1: 3 penalised to 2.0 -> 4 (draft 3 rejected)
    logits[2, 8] = 5.0  # a, pos 2: never reached
    logits[3, 7] = 5.0  # b, pos 0 -> 7 (draft 7 accepted)
    logits[4, 3], logits[4, 4] = 4.0, 2.5  # b, pos 1: 3 not in b's history -> 3 (draft accepted)
    logits[5, 9] = 5.0  # b bonus
    out = step_sampler(s).sample(logits, ["a", "b"], {"a": a, "b": b}, {"a": [3, 3], "b": [7, 3]}, None)
    assert out.token_ids == [[3, 4], [7, 3, 9]]
    assert out.num_rejected == {"a": 1, "b": 0}


# -- seeded random requests: the same tokens as without drafts --------------------------------------
SEEDED_PARAMS = [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, seed=12),
    SamplingParams(temperature=1.3, top_p=0.8, seed=13),
    SamplingParams(temperature=0.9, min_p=0.05, repetition_penalty=1.2, seed=14),
]


def _stepwise(noise: bool, params: SamplingParams, prompt: list[int], rows: torch.Tensor,
              drafts: list[int]) -> list[int]:
    """Samples the rows one step at a time (no drafts, its own Sampler): the tokens a request emits
    until one differs from its draft (or the drafts run out)."""
    s = Sampler(VOCAB, "cpu", seed=999)
    s.use_exponential_noise = noise
    st = make_state(s, "x", params, prompt=prompt)
    out = []
    for i in range(rows.shape[0]):
        tok = s.sample(rows[i:i + 1], [st.sampling]).sampled_token_ids[0]
        st.token_ids.append(tok)
        out.append(tok)
        if i >= len(drafts) or tok != drafts[i] or tok == EOS:  # a stop token ends the step
            break
    return out


@pytest.mark.parametrize("noise", [False, True], ids=["inverse_cdf", "exp_noise"])
def test_seeded_verification_draws_the_same_tokens_as_without_drafts(noise):
    g = torch.Generator().manual_seed(5)
    num_accepted = 0
    for trial in range(25):
        s = Sampler(VOCAB, "cpu", seed=trial)  # a different shared stream: seeded rows must not care
        s.use_exponential_noise = noise
        req_ids, states, drafts, blocks, expected = [], {}, {}, [], []
        for j, params in enumerate(SEEDED_PARAMS):
            k = (trial + j) % 4  # 0..3 drafts
            rows = torch.randn(k + 1, VOCAB, generator=g) * 2.0
            # Drafts: the row's argmax (often accepted) or a random token.
            d = [int(rows[i].argmax()) if torch.rand(1, generator=g) < 0.7 else
                 int(torch.randint(VOCAB, (1,), generator=g)) for i in range(k)]
            prompt = [int(t) for t in torch.randint(VOCAB, (5,), generator=g)]
            rid = f"r{j}"
            req_ids.append(rid)
            states[rid] = make_state(s, rid, params, prompt=prompt)
            if d:
                drafts[rid] = d
            blocks.append(rows)
            expected.append(_stepwise(noise, params, prompt, rows, d))
        out = step_sampler(s).sample(torch.cat(blocks), req_ids, states, drafts, None)
        assert out.req_ids == req_ids
        assert out.token_ids == expected, f"trial {trial}"
        num_accepted += sum(len(t) - 1 for t in out.token_ids)
    assert num_accepted > 10  # the comparison exercised accepted drafts, not only first-token rejections


# -- typical acceptance --------------------------------------------------------------------------------
def test_typical_acceptance_rule():
    typical = TypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.3)
    flat = torch.zeros(VOCAB)  # p = 1/16 = 0.0625 > min(0.09, 0.3 / 16)
    assert all(typical.accepts(flat, 1.0, d) for d in range(VOCAB))
    peaked = torch.zeros(VOCAB)
    peaked[3] = 10.0
    assert typical.accepts(peaked, 1.0, 3)
    assert not typical.accepts(peaked, 1.0, 5)  # p(5) ~ 5e-5
    # The threshold caps the bar: a low-entropy row still accepts a draft with p > threshold.
    two = torch.full((VOCAB,), -30.0)
    two[3], two[4] = 0.0, math.log(0.25 / 0.75)  # p = 0.75 / 0.25
    assert typical.accepts(two, 1.0, 4) and not TypicalAcceptance(0.3, 10.0).accepts(two, 1.0, 4)


def test_typical_acceptance_in_the_step_sampler():
    s = Sampler(VOCAB, "cpu", seed=0)
    typical = TypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.3)
    params = SamplingParams(temperature=1.0)
    flat_state, peak_state = make_state(s, "flat", params), make_state(s, "peak", params)
    flat = torch.zeros(3, VOCAB)
    peak = torch.zeros(3, VOCAB)
    peak[:, 3] = 12.0
    out = step_sampler(s, typical).sample(torch.cat([flat, peak]), ["flat", "peak"],
                                          {"flat": flat_state, "peak": peak_state},
                                          {"flat": [5, 6], "peak": [5, 6]}, None)
    # flat: both drafts typical -> accepted, plus a bonus token sampled from the last row.
    assert out.token_ids[0][:2] == [5, 6] and len(out.token_ids[0]) == 3
    # peaked: the unlikely draft 5 is replaced by the most likely token, and the step ends.
    assert out.token_ids[1] == [3]
    assert out.num_rejected == {"flat": 0, "peak": 2}
    assert peak_state.token_ids[-1] == 3 and flat_state.token_ids[-3:-1] == [5, 6]


def test_typical_acceptance_leaves_greedy_requests_exact():
    s = Sampler(VOCAB, "cpu")
    st = make_state(s, "g", GREEDY)
    flat_but_argmax_7 = torch.zeros(2, VOCAB)
    flat_but_argmax_7[:, 7] = 0.5  # p(5) is typical, but greedy takes the exact rule
    out = step_sampler(s, TypicalAcceptance(0.09, 0.3)).sample(flat_but_argmax_7, ["g"], {"g": st}, {"g": [5]},
                                                              None)
    assert out.token_ids == [[7]] and out.num_rejected == {"g": 1}


# -- logprobs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_one_entry_per_output_token(temperature):
    s = Sampler(VOCAB, "cpu", seed=3)
    params = SamplingParams(temperature=temperature, logprobs=2, seed=4 if temperature else None)
    st = make_state(s, "r", params)
    logits = peaked_rows([5, 7, 9, 10], top=30.0)  # so peaked that a random row is argmax too
    logits[1, 12] = 1.0
    out = step_sampler(s).sample(logits, ["r"], {"r": st}, {"r": [5, 7, 8]}, None)
    assert out.token_ids == [[5, 7, 9]]
    assert len(out.logprobs[0]) == 3
    for i, (tok, lp) in enumerate(zip(out.token_ids[0], out.logprobs[0])):
        ref = torch.log_softmax(logits[i], -1)
        assert lp.token_ids[0] == tok
        assert lp.logprobs[0] == pytest.approx(float(ref[tok]), abs=1e-5)
        assert len(lp.token_ids) == 3  # the sampled token, then the top 2


def test_logprobs_only_for_requests_that_ask():
    s = Sampler(VOCAB, "cpu")
    a = make_state(s, "a", SamplingParams(temperature=0.0, logprobs=1))
    b = make_state(s, "b", GREEDY)
    out = step_sampler(s).sample(peaked_rows([3, 4, 5, 6]), ["a", "b"], {"a": a, "b": b},
                                 {"a": [3], "b": [5]}, None)
    assert out.token_ids == [[3, 4], [5, 6]]
    assert [len(x) for x in out.logprobs] == [2, 0]
