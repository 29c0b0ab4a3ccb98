"""fused_experts (Triton grouped GEMM) against the torch reference, and the reference against a naive
per-token loop, with uneven expert loads: experts with no tokens, one expert taking most pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import reference
from aserve.kernels.fused_moe import block_config, fused_experts, moe_align_block_size


def _uneven_ids(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Each token's first expert is `num_experts - 2` (the hot one); the rest are drawn from the lower
    half of the experts, so the upper ones (but the hot one) get nothing. Distinct per token."""
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    hot = num_experts - 2
    for t in range(num_tokens):
        others = torch.randperm(max(num_experts // 2, top_k - 1), generator=gen)[: top_k - 1]
        ids[t] = torch.cat([torch.tensor([hot]), others])
    return ids


def _case(num_tokens, hidden, inter, num_experts, top_k, dtype, device, gen):
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    weights = torch.rand(num_tokens, top_k, generator=gen).softmax(-1)
    ids = _uneven_ids(num_tokens, num_experts, top_k, gen)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _naive(x, w13, w2, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            row = x[t].double()
            h = F.silu(w13[e, :inter].double() @ row) * (w13[e, inter:].double() @ row)
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


# (tokens, hidden, intermediate, experts, top_k, dtype)
SHAPES = [
    pytest.param(37, 40, 24, 8, 2, torch.float32, id="prefill-uneven-ragged-dims"),
    pytest.param(1, 64, 32, 4, 2, torch.float32, id="decode-one-token"),
    pytest.param(5, 48, 16, 6, 3, torch.float32, id="top3-small-block"),
    pytest.param(70, 32, 32, 4, 2, torch.float32, id="block-m-64-hot-expert-several-blocks"),
    pytest.param(23, 64, 48, 8, 2, torch.float16, id="fp16"),
]


@pytest.mark.parametrize("num_tokens, hidden, inter, num_experts, top_k, dtype", SHAPES)
def test_matches_reference(device, gen, num_tokens, hidden, inter, num_experts, top_k, dtype):
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, dtype, device, gen)
    counts = torch.bincount(ids.flatten().cpu(), minlength=num_experts)
    assert (counts == 0).any() and counts.max() >= num_tokens  # some experts idle, one takes every token
    got = fused_experts(x, w13, w2, weights, ids)
    want = reference.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    tol = {torch.float32: 1e-5, torch.float16: 3e-3}[dtype]
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_reference_matches_naive_loop(gen):
    x, w13, w2, weights, ids = _case(29, 24, 20, 8, 2, torch.float32, "cpu", gen)
    torch.testing.assert_close(reference.fused_moe(x, w13, w2, weights, ids).double(),
                               _naive(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_groups_pairs_by_expert(gen, block_m):
    num_experts, ids = 8, _uneven_ids(45, 8, 2, gen)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, num_experts, block_m)
    pairs = ids.numel()
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert int(num_padded) == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.numel() % block_m == 0 and expert_ids.numel() == sorted_ids.numel() // block_m
    real = sorted_ids[sorted_ids < pairs].long()
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[int(num_padded):] == pairs).all()  # beyond the padded total: padding only
    for block in range(int(num_padded) // block_m):
        entries = sorted_ids[block * block_m:(block + 1) * block_m].long()
        entries = entries[entries < pairs]
        assert len(entries) > 0 and (ids.flatten()[entries] == expert_ids[block]).all()
        assert (entries.diff() > 0).all()  # token order kept within an expert


def test_block_config_prefers_small_blocks_for_decode():
    assert block_config(2, 8)[0] == 16
    assert block_config(512, 8)[0] == 64


def test_rejects_mismatched_weights(device):
    x = torch.zeros(2, 8, device=device)
    ids = torch.zeros(2, 1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x, torch.zeros(2, 6, 8, device=device), torch.zeros(2, 8, 4, device=device),
                      torch.ones(2, 1, device=device), ids)
