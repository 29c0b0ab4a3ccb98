"""Speculative verification keeps the target's distribution exactly (random sampling, unseeded rows).

A fixed 8-token "model": p0 for the first output position, p1(. | t0) for the second. Drafts are
chosen adversarially (unlikely tokens; or a likely first and unlikely second). 20000 independent
requests verify the same drafts in one `StepSampler._verify` call; requests that stopped after one
token sample their second token in a plain step from p1(. | t0), as the next engine step would. The
empirical first-token and pair distributions must match p0 and p0 * p1 (chi-square; cells with an
expected count under 5 merged). The sampler's shared generator is seeded, so the test is
deterministic; with the two p-value thresholds at 5e-4 each, its false-alarm rate is <= 1e-3. A power
check shows the same counts reject the distribution a common wrong rule would give (resampling from
p including the rejected draft).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from aserve.runner.input_batch import CachedRequestState
from aserve.runner.sampling import Sampler
from aserve.runner.step_sampling import StepSampler
from aserve.runner.structured import StructuredOutputs
from aserve.sampling_params import SamplingParams

VOCAB = 8
N = 20000
ALPHA = 1e-3 / 2  # two tests per case

P0_LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, -2.5])
P1_LOGITS = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(17)) * 1.5  # row t0: p1(. | t0)
P2_LOGITS = torch.randn(VOCAB, generator=torch.Generator().manual_seed(18))  # the bonus row (unused by the test)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) restricted to the top_k tokens (renormalised), in float64."""
    x = logits.double() / params.temperature
    if 0 < params.top_k < VOCAB:
        kth = x.topk(params.top_k).values[-1]
        x = torch.where(x >= kth, x, torch.full_like(x, -float("inf")))
    return x.softmax(-1)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of `counts` against `probs`, cells with expected < 5 merged (cells
    with probability 0 must be empty: otherwise the p-value is 0)."""
    from scipy.stats import chi2

    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return 0.0
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    keep = expected >= 5
    obs = list(counts[keep])
    exp = list(expected[keep])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(expected[small].sum())
    obs, exp = np.asarray(obs, dtype=np.float64), np.asarray(exp, dtype=np.float64)
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(chi2.sf(stat, len(obs) - 1))


def run_case(params: SamplingParams, drafts: list[int], seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-token counts [V], pair counts [V*V] and the number of accepted drafts over N requests."""
    sampler = Sampler(VOCAB, "cpu", seed=seed)
    step = StepSampler(sampler, StructuredOutputs(None, max_num_rows=8))
    rows = [P0_LOGITS, P1_LOGITS[drafts[0]], P2_LOGITS][:len(drafts) + 1]
    block = torch.stack(rows)
    req_ids = [f"r{i}" for i in range(N)]
    states = {}
    for r in req_ids:
        tokens = [0, 1, 2]
        sampling = sampler.states.add(params, tokens, len(tokens), [])
        states[r] = CachedRequestState(r, tokens, len(tokens), params, [1], 2, sampling)
    logits = block.repeat(N, 1)
    out = step._verify(logits, req_ids, states, [list(drafts)] * N, None)
    assert out.req_ids == req_ids and not out.failed
    firsts = np.array([t[0] for t in out.token_ids])
    seconds = np.full(N, -1)
    accepted = 0
    for i, toks in enumerate(out.token_ids):
        assert 1 <= len(toks) <= len(drafts) + 1
        assert toks[:len(toks) - 1] == list(drafts[:len(toks) - 1])  # accepted drafts, then one token
        accepted += len(toks) - 1
        if len(toks) >= 2:
            seconds[i] = toks[1]
    # The requests that stopped after one token: their next step samples p1(. | t0), no drafts.
    rest = [i for i in range(N) if seconds[i] < 0]
    if rest:
        ids = [req_ids[i] for i in rest]
        nxt = step.sample(P1_LOGITS[torch.from_numpy(firsts[rest])], ids, states, {}, None)
        assert nxt.req_ids == ids
        seconds[rest] = [t[0] for t in nxt.token_ids]
    first_counts = np.bincount(firsts, minlength=VOCAB)
    pair_counts = np.bincount(firsts * VOCAB + seconds, minlength=VOCAB * VOCAB)
    return first_counts, pair_counts, accepted


def pair_probs(params: SamplingParams) -> np.ndarray:
    p0 = target_probs(P0_LOGITS, params)
    p1 = torch.stack([target_probs(P1_LOGITS[t], params) for t in range(VOCAB)])
    return (p0.unsqueeze(1) * p1).flatten().numpy()


def naive_first_probs(params: SamplingParams, d0: int) -> np.ndarray:
    """What 'accept d with p(d), else resample from p (d included)' gives for the first token."""
    p = target_probs(P0_LOGITS, params).numpy()
    q = (1 - p[d0]) * p
    q[d0] += p[d0]
    return q


def _ranked(logits: torch.Tensor) -> list[int]:
    return logits.argsort(descending=True).tolist()


P0_ORDER = _ranked(P0_LOGITS)
CASES = {
    # The least likely first token as the only draft.
    "one_unlikely": (SamplingParams(temperature=1.0), [P0_ORDER[-1]]),
    # Two unlikely drafts.
    "two_unlikely": (SamplingParams(temperature=1.0), [P0_ORDER[-1], _ranked(P1_LOGITS[P0_ORDER[-1]])[-1]]),
    # A likely first draft (often accepted), then the least likely second token: position 1's rule.
    "likely_then_unlikely": (SamplingParams(temperature=1.0), [P0_ORDER[0], _ranked(P1_LOGITS[P0_ORDER[0]])[-1]]),
    # Temperature and top-k: the second-least likely token inside the top 5, twice.
    "top_k_temperature": (SamplingParams(temperature=0.8, top_k=5), [P0_ORDER[4], _ranked(P1_LOGITS[P0_ORDER[4]])[4]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_verification_keeps_the_target_distribution(case):
    pytest.importorskip("scipy")
    params, drafts = CASES[case]
    start = time.perf_counter()
    first_counts, pair_counts, accepted = run_case(params, drafts, seed=1234)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"{elapsed:.1f} s"
    p0 = target_probs(P0_LOGITS, params).numpy()
    pairs = pair_probs(params)
    assert first_counts.sum() == N and pair_counts.sum() == N
    assert accepted > 0, "no draft was ever accepted: the case tests nothing about acceptance"
    p_first = chi_square_pvalue(first_counts, p0)
    p_pair = chi_square_pvalue(pair_counts, pairs)
    assert p_first > ALPHA, (p_first, first_counts, (p0 * N).round(1))
    assert p_pair > ALPHA, (p_pair, pair_counts, (pairs * N).round(1))
    # Power: the same counts refuse the distribution the naive resampling rule would give, where the
    # draft token's mass grows from p(d) to p(d) * (2 - p(d)) (only measurable for an unlikely draft).
    if p0[drafts[0]] < 0.1:
        assert chi_square_pvalue(first_counts, naive_first_probs(params, drafts[0])) < ALPHA


def test_acceptance_rate_is_the_draft_probability():
    """A single draft d is accepted exactly when the sampled token is d: with probability p(d)."""
    params, drafts = SamplingParams(temperature=1.0), [P0_ORDER[1]]
    first_counts, _, accepted = run_case(params, drafts, seed=99)
    p = float(target_probs(P0_LOGITS, params)[drafts[0]])
    assert accepted == first_counts[drafts[0]]
    sigma = (p * (1 - p) / N) ** 0.5
    assert abs(accepted / N - p) < 4.5 * sigma
