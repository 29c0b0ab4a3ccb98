"""LoRA delta kernels: the CPU grouped path and the torch references against a naive per-token loop;
the Triton BGMV kernels against the references (interpreted on CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import lora_ops
from aserve.kernels.lora_ops import lora_delta_cpu, ref_lora_expand, ref_lora_shrink
from aserve.model.lora.mapping import build_lora_mapping

SLICES = (12, 6, 6)  # a q|k|v-like fused layer
K, MAX_RANK, SLOTS = 20, 8, 3
RANKS = [8, 4, 0]  # slot 2 empty


def _weights(gen, slices=SLICES, ranks=RANKS, bias=True):
    """Stacked weights in the kernels' layout, zero past each slot's rank."""
    n, out = len(slices), sum(slices)
    a = torch.randn(SLOTS, MAX_RANK, n, K, generator=gen)
    b = torch.randn(SLOTS, out, MAX_RANK, generator=gen)
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        b[s, :, r:] = 0
    lora_bias = torch.randn(SLOTS, out, generator=gen) if bias else None
    if lora_bias is not None:
        for s, r in enumerate(ranks):
            if r == 0:
                lora_bias[s] = 0
    return a.reshape(SLOTS, MAX_RANK * n, K), b, lora_bias


def _naive(x, slots, a, b, bias, slices):
    """Per token, per shard, float64."""
    n = len(slices)
    out = torch.zeros(x.shape[0], sum(slices), dtype=torch.float64)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        a_s = a[s].double().view(MAX_RANK, n, K)
        off = 0
        for i, size in enumerate(slices):
            out[t, off:off + size] = b[s, off:off + size].double() @ (a_s[:, i] @ x[t].double())
            off += size
        if bias is not None:
            out[t] += bias[s].double()
    return out


SLOT_CASES = [[0, -1, 1, 0, 2, -1, 1, 1, 0, -1, 0], [1] * 11, [-1, -1, 0, -1, -1, -1, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("slots", SLOT_CASES, ids=["mixed", "one-slot-whole-batch", "one-token"])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_delta_matches_naive(slots, bias):
    gen = torch.Generator().manual_seed(0)
    a, b, lora_bias = _weights(gen, bias=bias)
    x = torch.randn(len(slots), K, generator=gen)
    mapping = build_lora_mapping(slots, "cpu")
    want = _naive(x, slots, a, b, lora_bias, SLICES)
    got = lora_delta_cpu(x, mapping, a, b, RANKS, SLICES, lora_bias)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    # added into an existing output in its dtype (bf16 here), base rows untouched
    y = torch.randn(len(slots), sum(SLICES), generator=gen).to(torch.bfloat16)
    before = y.clone()
    out = lora_delta_cpu(x, mapping, a, b, RANKS, SLICES, lora_bias, y=y)
    assert out is y and y.dtype == torch.bfloat16
    base = torch.tensor(slots) < 0
    assert torch.equal(y[base], before[base])
    torch.testing.assert_close(y.double(), (before.double() + want).to(torch.bfloat16).double(), atol=0.1, rtol=0.02)


def test_cpu_delta_uses_only_the_slot_rank():
    """Garbage past a slot's rank is never read (the CPU path slices by rank)."""
    gen = torch.Generator().manual_seed(1)
    a, b, _ = _weights(gen, bias=False)
    slots = [1, 1, 0, -1]
    x = torch.randn(4, K, generator=gen)
    want = _naive(x, slots, a, b, None, SLICES)
    a.view(SLOTS, MAX_RANK, 3, K)[1, RANKS[1]:] = 1e6
    b[1, :, RANKS[1]:] = 1e6
    got = lora_delta_cpu(x, build_lora_mapping(slots, "cpu"), a, b, RANKS, SLICES)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("slots", SLOT_CASES[:2], ids=["mixed", "one-slot"])
def test_references_match_naive(slots):
    gen = torch.Generator().manual_seed(2)
    a, b, lora_bias = _weights(gen)
    x = torch.randn(len(slots), K, generator=gen)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    y = torch.randn(len(slots), sum(SLICES), generator=gen)
    got = ref_lora_expand(ref_lora_shrink(x, a, token_slots), b, token_slots, y, SLICES, lora_bias)
    torch.testing.assert_close(got.double(), y.double() + _naive(x, slots, a, b, lora_bias, SLICES),
                               atol=1e-4, rtol=1e-5)


def test_mapping_groups_tokens_by_slot():
    mapping = build_lora_mapping([2, -1, 0, 2, 0, -1, 1], "cpu")
    assert mapping.token_slots.dtype == torch.int32 and mapping.token_slots.tolist() == [2, -1, 0, 2, 0, -1, 1]
    assert mapping.perm.tolist() == [2, 4, 6, 0, 3]
    assert mapping.segments == ((0, 0, 2), (1, 2, 3), (2, 3, 5))
    assert mapping.active_slots == (0, 1, 2) and mapping.num_tokens == 7
    assert build_lora_mapping([-1, -1], "cpu") is None
    assert build_lora_mapping([], "cpu") is None


# -- Triton (interpreted on CPU: float32 only; bf16 dots are wrong under the interpreter) -------------
needs_triton = pytest.mark.skipif(not lora_ops.HAVE_TRITON, reason="triton is not installed")


@needs_triton
@pytest.mark.parametrize("slices", [SLICES, (40,)], ids=["qkv", "plain"])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_kernels_match_references(device, slices, bias):
    gen = torch.Generator().manual_seed(3)
    a, b, lora_bias = _weights(gen, slices, bias=bias)
    slots = [0, -1, 1, 0, 2, -1, 1]
    x = torch.randn(len(slots), K, generator=gen)
    token_slots = torch.tensor(slots, dtype=torch.int32)
    y = torch.randn(len(slots), sum(slices), generator=gen)
    want_shrunk = ref_lora_shrink(x, a, token_slots)
    want = ref_lora_expand(want_shrunk, b, token_slots, y, slices, lora_bias)
    dev = [t.to(device) if t is not None else None for t in (x, a, b, lora_bias, token_slots, y)]
    xd, ad, bd, biasd, slotsd, yd = dev
    shrunk = lora_ops.lora_shrink(xd, ad, slotsd)
    torch.testing.assert_close(shrunk.cpu(), want_shrunk, atol=1e-4, rtol=1e-5)
    out = lora_ops.lora_expand(shrunk, bd, slotsd, yd, slices, biasd)
    assert out is yd
    torch.testing.assert_close(yd.cpu(), want, atol=1e-4, rtol=1e-5)
    base = torch.tensor(slots) < 0
    assert torch.equal(yd.cpu()[base], y[base])  # base tokens' rows untouched


@needs_triton
def test_triton_shape_errors_name_the_argument():
    a = torch.zeros(2, 8, 16)
    with pytest.raises(ValueError, match="lora_a"):
        lora_ops.lora_shrink(torch.zeros(3, 15), a, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_slots"):
        lora_ops.lora_shrink(torch.zeros(3, 16), a, torch.zeros(3, dtype=torch.int64))
