"""Sampler: support sets and frequencies of the filters, penalties, masks, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from aserve.runner.sampling import (
    RequestSampling, Sampler, compute_prompt_logprobs, penalties, processors, topk_topp)
from aserve.sampling_params import SamplingParams


def row(s: Sampler, params: SamplingParams, prompt=(), outputs=(), stop_ids=()) -> RequestSampling:
    """A live request on `s` with the given token history (new tokens are appended to `.token_ids`)."""
    return s.states.add(params, list(prompt) + list(outputs), len(prompt), list(stop_ids))


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000, *, noise: bool = False,
              candidates: int | None = None, seed: int = 0) -> torch.Tensor:
    """`n` independent draws of one distribution: a batch of `n` identical unseeded rows."""
    vocab = logits_row.numel()
    s = Sampler(vocab, "cpu", seed=seed)
    s.use_exponential_noise = noise
    if candidates is not None:
        s.top_p_candidates = candidates
    out = s.sample(logits_row.expand(n, vocab).contiguous(), [row(s, params) for _ in range(n)])
    return torch.tensor(out.sampled_token_ids)


def assert_frequencies(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Every sample has positive probability, every token with probability > 2% shows up, and the
    observed frequencies sit within 5 standard deviations of `probs`."""
    n = samples.numel()
    support = set(torch.nonzero(probs > 0).flatten().tolist())
    seen = set(samples.tolist())
    assert seen <= support, f"sampled outside the support: {sorted(seen - support)}"
    assert {t for t in support if probs[t] > 0.02} <= seen
    freq = torch.bincount(samples, minlength=probs.numel()).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert torch.all((freq - probs.double()).abs() <= 5 * sigma + 1e-3), (freq, probs)


def nucleus_probs(logits: torch.Tensor, top_p: float, top_k: int = -1, min_p: float = 0.0) -> torch.Tensor:
    """Reference: the renormalized distribution after top-k, top-p and min-p, by sorting."""
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = logits.numel() if top_k < 1 else top_k
    kept = probs[order[:k]] / probs[order[:k]].sum()
    mass_before = kept.cumsum(0) - kept
    keep[order[:k][mass_before < top_p]] = True
    out = torch.where(keep, probs, torch.zeros_like(probs))
    out = out / out.sum()
    if min_p > 0:
        out = torch.where(out >= min_p * out.max(), out, torch.zeros_like(out))
        out = out / out.sum()
    return out.float()


@pytest.fixture
def logits64() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, generator=g) * 1.5


# -- greedy -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [64, 1000, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(16, vocab, generator=g) * 3).to(dtype)
    logits[3, :] = 0.0  # ties: the first index wins, as with torch.argmax
    logits[4, 7] = logits[4, 900 % vocab] = 50.0
    s = Sampler(vocab, "cpu")
    out = s.sample(logits, [row(s, SamplingParams(temperature=0)) for _ in range(16)])
    assert out.sampled_token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 16


def test_greedy_rows_in_a_mixed_batch_are_argmax(logits64):
    logits = torch.stack([logits64, logits64.flip(0), logits64 * 2, logits64 - 1])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0, logit_bias={0: 0.0}), SamplingParams(temperature=0.7, top_k=3)]
    s = Sampler(64, "cpu")
    out = s.sample(logits, [row(s, p) for p in params])
    assert out.sampled_token_ids[0] == int(logits[0].argmax())
    assert out.sampled_token_ids[2] == int(logits[2].argmax())


def test_sample_does_not_modify_logits(logits64):
    logits = logits64.expand(4, 64).clone()
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_p=0.8, repetition_penalty=1.3, logit_bias={1: 5.0}),
              SamplingParams(temperature=0, allowed_token_ids=[1, 2]),
              SamplingParams(temperature=1.0, min_p=0.2, frequency_penalty=1.0),
              SamplingParams(temperature=1.0, top_k=4)]
    s = Sampler(64, "cpu")
    s.sample(logits, [row(s, p, prompt=[1, 2], outputs=[3, 3]) for p in params])
    assert torch.equal(logits, before)


# -- distributions ----------------------------------------------------------------------------------
@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_temperature_sampling_matches_softmax(logits64, noise, temperature):
    samples = draw_many(logits64, SamplingParams(temperature=temperature), noise=noise)
    assert_frequencies(samples, (logits64 / temperature).softmax(-1))


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("top_k", [1, 5, 20])
def test_top_k_support_and_frequencies(logits64, noise, top_k):
    samples = draw_many(logits64, SamplingParams(temperature=0.9, top_k=top_k), noise=noise)
    assert_frequencies(samples, nucleus_probs(logits64 / 0.9, 1.0, top_k=top_k))


@pytest.mark.parametrize("candidates", [None, 4, 16])  # None: the sort; 4 / 16: the candidate shortcut
@pytest.mark.parametrize("top_p", [0.3, 0.75, 0.95])
def test_top_p_support_and_frequencies(logits64, top_p, candidates):
    samples = draw_many(logits64, SamplingParams(temperature=1.0, top_p=top_p), candidates=candidates)
    assert_frequencies(samples, nucleus_probs(logits64, top_p))


def test_top_p_with_the_noise_draw(logits64):
    samples = draw_many(logits64, SamplingParams(temperature=0.8, top_p=0.7), noise=True)
    assert_frequencies(samples, nucleus_probs(logits64 / 0.8, 0.7))


@pytest.mark.parametrize("candidates", [None, 8])
def test_top_k_then_top_p_renormalizes(logits64, candidates):
    params = SamplingParams(temperature=1.0, top_k=10, top_p=0.6)
    samples = draw_many(logits64, params, candidates=candidates)
    assert_frequencies(samples, nucleus_probs(logits64, 0.6, top_k=10))


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("extra", [{}, {"top_k": 12}, {"top_p": 0.9}])
def test_min_p_support_and_frequencies(logits64, noise, extra):
    params = SamplingParams(temperature=1.0, min_p=0.15, **extra)
    samples = draw_many(logits64, params, noise=noise, candidates=8)
    ref = nucleus_probs(logits64, extra.get("top_p", 1.0), top_k=extra.get("top_k", -1), min_p=0.15)
    assert_frequencies(samples, ref)


def test_min_p_one_keeps_only_the_most_likely(logits64):
    samples = draw_many(logits64, SamplingParams(temperature=1.0, min_p=1.0), n=200)
    assert set(samples.tolist()) == {int(logits64.argmax())}


def test_rows_with_different_filters_in_one_batch(logits64):
    """Each row of a mixed batch keeps its own support."""
    n = 600
    params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0)]
    s = Sampler(64, "cpu")
    s.top_p_candidates = 8
    rows = [row(s, params[i % len(params)]) for i in range(n)]
    tokens = torch.tensor(s.sample(logits64.expand(n, 64).contiguous(), rows).sampled_token_ids)
    refs = [nucleus_probs(logits64, 1.0, top_k=3), nucleus_probs(logits64, 0.5),
            nucleus_probs(logits64, 1.0, min_p=0.3), logits64.softmax(-1), None]
    for i, ref in enumerate(refs):
        got = tokens[i::len(params)]
        if ref is None:
            assert set(got.tolist()) == {int(logits64.argmax())}
        else:
            assert set(got.tolist()) <= set(torch.nonzero(ref > 0).flatten().tolist())
            assert set(got.tolist()) >= set(torch.nonzero(ref > 0.05).flatten().tolist())


def test_top_p_shortcut_on_a_large_vocabulary_matches_the_sort():
    """V large enough for the chunked top-k and both candidate stages: seeded rows draw what the sort gives."""
    vocab, n = 8192, 64
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, vocab, generator=g) * torch.linspace(1, 8, n).unsqueeze(1)  # flat to peaked
    results = []
    for candidates in (256, 10**9):  # 10**9: never the shortcut
        s = Sampler(vocab, "cpu", seed=5)
        s.top_p_candidates = candidates
        rows = [row(s, SamplingParams(temperature=1.0, top_p=0.8, seed=i)) for i in range(n)]
        results.append(s.sample(logits, rows).sampled_token_ids)
    assert results[0] == results[1]


@pytest.mark.parametrize("k", [1, 7, 16, 40])
def test_chunked_top_k_matches_torch(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, 4096, generator=g)
    x[0, :] = 0.5  # all ties
    vals, ids = topk_topp.topk(x, k)
    ref_vals, _ = x.topk(k, dim=-1)
    assert torch.equal(vals, ref_vals)
    assert torch.equal(x.gather(1, ids), vals)
    assert all(len(set(r)) == k for r in ids.tolist())


def test_two_level_argmax_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4096, generator=g)
    x[1] = 1.0
    x[2, 100] = x[2, 3000] = 9.0
    x[3, :] = float("-inf")
    x[3, 4095] = 0.0
    assert torch.equal(topk_topp.argmax(x), x.argmax(-1))


# -- penalties, bias, masks -------------------------------------------------------------------------
def processed_logits(s: Sampler, logits: torch.Tensor, rows: list[RequestSampling]) -> torch.Tensor:
    """The logits after bias, masks, processors and penalties (before temperature)."""
    work = logits.clone()
    penalties.apply_bias_and_masks(work, rows)
    assert processors.apply_processors(work, rows) == {}
    penalties.apply_penalties(work, rows, s.states.gather(rows))
    return work


def test_repetition_penalty_exact():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    s = Sampler(6, "cpu")
    r = row(s, SamplingParams(repetition_penalty=2.0), prompt=[0, 1], outputs=[2, 2])
    got = processed_logits(s, logits, [r])
    assert torch.allclose(got, torch.tensor([[1.0, -4.0, 0.5, -1.0, 0.5, 3.0]]))


def test_frequency_and_presence_penalties_exact():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, -1.0]])
    s = Sampler(5, "cpu")
    r = row(s, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=[3], outputs=[0, 0, 0, 1, 4])
    got = processed_logits(s, logits, [r])
    # token 0: 1 - 3*0.5 - 0.25; token 1: 1 - 0.5 - 0.25; prompt-only token 3 untouched.
    assert torch.allclose(got, torch.tensor([[-0.75, 0.25, 1.0, 1.0, -1.75]]))


def test_all_penalties_together_follow_the_reference_order():
    vocab = 32
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, vocab, generator=g) * 2
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=-0.4),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.8),
              SamplingParams(presence_penalty=1.0),
              SamplingParams(frequency_penalty=-1.0, temperature=0),
              SamplingParams(repetition_penalty=1.2, presence_penalty=0.1)]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 3, 8, 0, 2, 0)]
    outputs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 4, 0, 6, 12, 0)]
    s = Sampler(vocab, "cpu")
    rows = [row(s, p, prompt=pr, outputs=o) for p, pr, o in zip(params, prompts, outputs)]
    expected = logits.clone()
    for i, (p, pr, o) in enumerate(zip(params, prompts, outputs)):
        for t in set(pr) | set(o):
            x = expected[i, t]
            expected[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(o):
            expected[i, t] -= p.frequency_penalty * o.count(t) + p.presence_penalty
    assert torch.allclose(processed_logits(s, logits, rows), expected, atol=1e-6)


def test_output_token_buffer_follows_the_appended_list():
    s = Sampler(8, "cpu")
    r = row(s, SamplingParams(frequency_penalty=1.0), outputs=[1])
    logits = torch.zeros(1, 8)
    assert processed_logits(s, logits, [r])[0, 1] == -1.0
    for t in [1, 2] + [3] * 40:  # grows past the initial buffer
        r.token_ids.append(t)
    got = processed_logits(s, logits, [r])[0]
    assert got[1] == -2.0 and got[2] == -1.0 and got[3] == -40.0


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    s = Sampler(4, "cpu")
    assert s.sample(logits, [row(s, SamplingParams(temperature=0), outputs=[0])]).sampled_token_ids == [0]
    penalized = row(s, SamplingParams(temperature=0, frequency_penalty=2.0), outputs=[0])
    assert s.sample(logits, [penalized]).sampled_token_ids == [1]


def test_logit_bias_is_added():
    logits = torch.zeros(2, 10)
    s = Sampler(10, "cpu")
    rows = [row(s, SamplingParams(logit_bias={3: 2.5, 7: -100})), row(s, SamplingParams())]
    got = processed_logits(s, logits, rows)
    expected = torch.zeros(2, 10)
    expected[0, 3], expected[0, 7] = 2.5, -100.0
    assert torch.equal(got, expected)
    greedy = s.sample(logits, [row(s, SamplingParams(temperature=0, logit_bias={6: 1.0}))] * 2)
    assert greedy.sampled_token_ids == [6, 6]


def test_allowed_token_ids_restrict_sampling(logits64):
    allowed = [5, 17, 40, 63]
    samples = draw_many(logits64, SamplingParams(temperature=1.0, allowed_token_ids=allowed), n=2000)
    ref = torch.zeros(64)
    ref[allowed] = logits64[allowed].softmax(-1)
    assert_frequencies(samples, ref)
    s = Sampler(64, "cpu")
    got = processed_logits(s, logits64.unsqueeze(0), [row(s, SamplingParams(allowed_token_ids=allowed))])[0]
    assert torch.equal(got[allowed], logits64[allowed])
    assert torch.isinf(got).sum() == 60


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])  # token 1 = EOS, token 2 = a stop token
    s = Sampler(4, "cpu")
    r = row(s, SamplingParams(temperature=0, min_tokens=2), stop_ids=[1, 2])
    assert s.sample(logits, [r]).sampled_token_ids == [3]
    r.token_ids.append(3)
    assert s.sample(logits, [r]).sampled_token_ids == [3]
    r.token_ids.append(3)
    assert s.sample(logits, [r]).sampled_token_ids == [1]


def test_min_tokens_never_samples_a_stop_token(logits64):
    stops = [int(i) for i in logits64.topk(3).indices]
    samples = draw_many(logits64, SamplingParams(temperature=1.0, min_tokens=1), n=2000)
    assert set(stops) & set(samples.tolist())  # they are likely without the mask...
    s = Sampler(64, "cpu")
    rows = [row(s, SamplingParams(temperature=1.0, min_tokens=1), stop_ids=stops) for _ in range(2000)]
    masked = s.sample(logits64.expand(2000, 64).contiguous(), rows).sampled_token_ids
    assert not set(stops) & set(masked)


def test_logits_processors_both_arities():
    seen = {}

    def two(output_ids, logits):
        seen["two"] = list(output_ids)
        logits[2] += 100.0
        return logits

    def three(prompt_ids, output_ids, logits):
        seen["three"] = (list(prompt_ids), list(output_ids))
        out = logits.clone()
        out[5] = 1000.0
        return out

    s = Sampler(8, "cpu")
    logits = torch.zeros(2, 8)
    rows = [row(s, SamplingParams(temperature=0, logits_processors=[two]), prompt=[1], outputs=[4]),
            row(s, SamplingParams(temperature=0, logits_processors=[two, three]), prompt=[7], outputs=[6])]
    assert s.sample(logits, rows).sampled_token_ids == [2, 5]
    assert seen == {"two": [6], "three": ([7], [6])}


def test_a_bad_logits_processor_fails_its_row_only():
    """A processor that raises or returns something else fails its row (reported by position); the
    other rows get the tokens they get without it, and no randomness is consumed for the failed rows."""
    def boom(output_ids, logits):
        raise RuntimeError("boom")

    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    healthy = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3),
               SamplingParams(temperature=1.0)]
    s = Sampler(8, "cpu", seed=1)
    alone = s.sample(logits[[0, 2, 4]], [row(s, p) for p in healthy]).sampled_token_ids
    s = Sampler(8, "cpu", seed=1)
    rows = [row(s, healthy[0]), row(s, SamplingParams(logits_processors=[boom])), row(s, healthy[1]),
            row(s, SamplingParams(temperature=0, logprobs=1, logits_processors=[lambda a, b: None])),
            row(s, healthy[2])]
    out = s.sample(logits, rows)
    assert out.sampled_token_ids == alone
    assert out.logprobs == [None] * 3
    assert set(out.failed) == {1, 3}
    assert "boom" in out.failed[1] and "RuntimeError" in out.failed[1]
    assert "must return the logits row" in out.failed[3] and "NoneType" in out.failed[3]
    everyone_fails = s.sample(logits[:1], [rows[1]])
    assert everyone_fails.sampled_token_ids == [] and set(everyone_fails.failed) == {0}


def test_an_unusable_logits_processor_signature_fails_at_add():
    s = Sampler(8, "cpu")
    with pytest.raises(ValueError, match="logits_processors"):
        s.states.add(SamplingParams(logits_processors=[lambda a: a]), [1], 1, [])
    assert s.states.num_live == 0


def test_states_reuse_freed_rows_and_grow():
    s = Sampler(8, "cpu")
    rows = [row(s, SamplingParams(temperature=0.5 + i / 100)) for i in range(40)]  # past the initial capacity
    assert s.states.num_live == 40
    assert s.states.gather(rows).table[:, 0].tolist() == pytest.approx([0.5 + i / 100 for i in range(40)])
    s.states.remove(rows[7])
    again = row(s, SamplingParams(temperature=2.0))
    assert again.slot == rows[7].slot and s.states.num_live == 40
    assert s.states.gather([rows[6], again, rows[8]]).table[:, 0].tolist() == pytest.approx([0.56, 2.0, 0.58])


# -- seeds ------------------------------------------------------------------------------------------
SEEDED_VARIANTS = [
    SamplingParams(temperature=0.9, seed=1234),
    SamplingParams(temperature=0.9, top_k=7, seed=1234),
    SamplingParams(temperature=0.9, top_p=0.8, seed=99),
    SamplingParams(temperature=1.2, min_p=0.05, top_k=30, top_p=0.95, seed=7, repetition_penalty=1.1),
]


@pytest.mark.parametrize("noise", [False, True])
@pytest.mark.parametrize("params", SEEDED_VARIANTS, ids=range(len(SEEDED_VARIANTS)))
def test_seeded_request_is_reproducible_whatever_the_batch(params, noise):
    vocab, steps = 256, 40
    g = torch.Generator().manual_seed(11)
    step_logits = torch.randn(steps, vocab, generator=g) * 2  # the seeded request's logits per step

    def run(batch_of: int) -> list[int]:
        s = Sampler(vocab, "cpu", seed=batch_of)
        s.use_exponential_noise = noise
        s.top_p_candidates = 16
        seeded = row(s, params, prompt=[1, 2, 3])
        others = [row(s, p, prompt=[4]) for p in (
            SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(temperature=0.5, top_k=50),
            SamplingParams(temperature=1.0, top_p=0.3, seed=5), SamplingParams(temperature=0.7, top_k=3, seed=1234),
            SamplingParams(temperature=1.0, top_p=0.99))][:batch_of]
        tokens = []
        for t in range(steps):
            rows = others[:len(others) // 2] + [seeded] + others[len(others) // 2:]
            noise_logits = torch.randn(len(rows), vocab, generator=g) * 3
            noise_logits[len(others) // 2] = step_logits[t]
            out = s.sample(noise_logits, rows).sampled_token_ids
            token = out[len(others) // 2]
            tokens.append(token)
            for r, tok in zip(rows, out):
                r.token_ids.append(tok)
        return tokens

    alone = run(0)
    assert run(3) == alone
    assert run(6) == alone
    assert len(set(alone)) > 3  # really random


def test_different_seeds_and_unseeded_rows_differ(logits64):
    s = Sampler(64, "cpu")
    rows = [row(s, SamplingParams(temperature=1.0, seed=i)) for i in range(2)] + \
        [row(s, SamplingParams(temperature=1.0)) for _ in range(2)]
    seqs = [[] for _ in rows]
    for _ in range(30):
        for seq, tok in zip(seqs, s.sample(logits64.expand(4, 64).contiguous(), rows).sampled_token_ids):
            seq.append(tok)
    assert seqs[0] != seqs[1] and seqs[2] != seqs[3]


def test_shared_generator_is_seeded_by_the_sampler_seed(logits64):
    a = draw_many(logits64, SamplingParams(temperature=1.0), n=50, seed=3)
    b = draw_many(logits64, SamplingParams(temperature=1.0), n=50, seed=3)
    c = draw_many(logits64, SamplingParams(temperature=1.0), n=50, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)


# -- logprobs ---------------------------------------------------------------------------------------
def check_entry(entry, lp_row: torch.Tensor, token: int, num: int) -> None:
    assert entry.token_ids[0] == token
    assert len(entry.token_ids) == len(entry.logprobs) == len(entry.ranks) == 1 + num
    for t, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
        assert math.isclose(lp, float(lp_row[t]), abs_tol=1e-5)
        assert rank == 1 + int((lp_row > lp_row[t]).sum())
    top = entry.token_ids[1:]
    assert top == lp_row.topk(num).indices.tolist()
    assert entry.ranks[1:] == sorted(entry.ranks[1:])


def test_logprobs_are_raw_model_logprobs():
    vocab = 100
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, vocab, generator=g) * 2
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=5, repetition_penalty=1.5, logit_bias={0: 50}),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, logprobs=2)]
    s = Sampler(vocab, "cpu")
    out = s.sample(logits.to(torch.bfloat16), [row(s, p, prompt=[1, 2]) for p in params])
    raw = torch.log_softmax(logits.to(torch.bfloat16).float(), -1)
    assert out.logprobs[1] is None
    assert out.sampled_token_ids[0] == 0  # the bias wins the sampling, the logprobs stay raw
    check_entry(out.logprobs[0], raw[0], 0, 5)
    check_entry(out.logprobs[2], raw[2], out.sampled_token_ids[2], 0)
    assert out.logprobs[2].ranks == [1]
    check_entry(out.logprobs[3], raw[3], out.sampled_token_ids[3], 2)


def test_logprob_ranks_with_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    s = Sampler(5, "cpu")
    out = s.sample(logits, [row(s, SamplingParams(temperature=0, logprobs=4))])
    entry = out.logprobs[0]
    assert entry.token_ids[0] == 1 and entry.ranks[0] == 1
    assert entry.ranks[1:] == [1, 1, 1, 4]
    assert sorted(entry.token_ids[1:4]) == [1, 2, 4] and entry.token_ids[4] == 3


def test_compute_prompt_logprobs():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 50, generator=g)
    targets = torch.tensor([3, 49, 0, 7, 7, 20])
    entries = compute_prompt_logprobs(logits, targets, 3)
    lp = torch.log_softmax(logits, -1)
    assert len(entries) == 6
    for i, e in enumerate(entries):
        check_entry(e, lp[i], int(targets[i]), 3)
    assert [e.token_ids for e in compute_prompt_logprobs(logits, targets, 0)] == [[t] for t in targets.tolist()]
    assert compute_prompt_logprobs(logits[:0], targets[:0], 2) == []
