"""LoRA delta kernels: the CPU grouped path and the torch references against a naive per-token loop;
the Triton BGMV kernels against the references (interpreted on CPU, float32); the CPU C kernel
(`lora_cpu.c`, bf16) against the references, on this CPU's build and portable ones."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import pytest
import torch

from aserve.kernels import cpu_ops, lora_cpu, lora_ops
from aserve.kernels.lora_ops import lora_delta_cpu, ref_lora_expand, ref_lora_shrink
from aserve.model.lora.mapping import build_lora_mapping
from tests.support.cpu_marches import skip_unless_this_cpu_runs

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


# -- CPU C kernel (aserve/kernels/lora_cpu.c) against the fp32 torch references ---------------------------
# this CPU's build and portable ones (AVX512 without BF16, AVX2, SSE), so every code path is checked here
C_MARCHES = ["native"] + (["x86-64-v4", "x86-64-v3", "x86-64-v2"] if platform.machine() in ("x86_64", "AMD64")
                          else [])


@pytest.fixture(scope="module", params=C_MARCHES)
def lora_kernel(request) -> lora_cpu.LoRAKernel:
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")
    skip_unless_this_cpu_runs(request.param)
    try:
        return lora_cpu.build(request.param)
    except (OSError, subprocess.CalledProcessError) as e:  # e.g. a compiler without that -march
        pytest.skip(f"cannot build for {request.param}: {e}")


def _c_case(gen, slices, k, ranks, max_rank=16, bias=True):
    """bf16 weights in the kernels' layout (garbage past each slot's rank: never read)."""
    n, out, slots = len(slices), sum(slices), len(ranks)
    a = torch.randn(slots, max_rank * n, k, generator=gen).bfloat16()
    b = torch.randn(slots, out, max_rank, generator=gen).bfloat16()
    lora_bias = torch.randn(slots, out, generator=gen).bfloat16() if bias else None
    clean_a, clean_b = a.clone(), b.clone()
    for s, r in enumerate(ranks):
        clean_a.view(slots, max_rank, n, k)[s, r:] = 0
        clean_b[s, :, r:] = 0
        a.view(slots, max_rank, n, k)[s, r:] = 1e4
        b[s, :, r:] = 1e4
    tiles = torch.stack([lora_cpu.tile_b(b[s]) for s in range(slots)])
    return a, b, tiles, lora_bias, clean_a, clean_b


@pytest.mark.parametrize(("slices", "k"), [((96, 32, 37), 64), ((40,), 20), ((1536, 1536), 576), ((12, 6, 6), 48)],
                         ids=["qkv-ragged", "plain-k20", "gate-up", "small-shards"])
@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_c_kernel_matches_the_references(lora_kernel, slices, k, y_dtype, bias):
    gen = torch.Generator().manual_seed(5)
    ranks = [16, 8, 0, 3]  # slot 2: no adapter on this layer (adds nothing, not even its bias)
    a, _, tiles, lora_bias, clean_a, clean_b = _c_case(gen, slices, k, ranks, bias=bias)
    # decode-like (interleaved, 1 to 11 tokens a slot: every register block size), base tokens, a slot
    # out of range (adds nothing)
    slots = [0, 1, -1, 3, 2, 0, 0, 1, 3, 3, -1, 0, 1, 7, *([0] * 8), *([3] * 3)]
    token_slots = torch.tensor(slots, dtype=torch.int32)
    x = torch.randn(len(slots), k, generator=gen).bfloat16()
    y = (torch.randn(len(slots), sum(slices), generator=gen) * 4).to(y_dtype)
    used = torch.tensor([s if 0 <= s < 4 and ranks[s] else -1 for s in slots], dtype=torch.int32)
    ref_bias = None if lora_bias is None else lora_bias.float()
    want = ref_lora_expand(ref_lora_shrink(x, clean_a, used), clean_b.float(), used, y.float(), slices, ref_bias)
    got = y.clone()
    out = lora_kernel.lora_delta(x, token_slots, a, torch.tensor(ranks), tiles, lora_cpu.slice_array(slices), got,
                                 lora_bias)
    assert out is got and got.dtype == y_dtype
    untouched = used < 0
    assert torch.equal(got[untouched], y[untouched])
    if y_dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    else:  # fp32 inside, y rounded once: within one bf16 step of the rounded reference
        step = want.abs().clamp_min(1e-30) * 2**-7
        assert bool(((got.float() - want).abs() <= step + 1e-3).all())


def test_c_kernel_takes_any_token_count(lora_kernel):
    """No tokens; a prefill-sized step of one slot per contiguous run (the grouped path's case)."""
    gen = torch.Generator().manual_seed(6)
    slices, k, ranks = (64, 32), 64, [16, 16]
    a, _, tiles, _, clean_a, clean_b = _c_case(gen, slices, k, ranks, bias=False)
    args = (torch.tensor(ranks), tiles, lora_cpu.slice_array(slices))
    empty = torch.zeros(0, 96)
    lora_kernel.lora_delta(torch.zeros(0, k, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.int32), a, *args,
                           empty)
    slots = [0] * 150 + [-1] * 20 + [1] * 130
    x = torch.randn(len(slots), k, generator=gen).bfloat16()
    token_slots = torch.tensor(slots, dtype=torch.int32)
    y = torch.zeros(len(slots), 96)
    want = ref_lora_expand(ref_lora_shrink(x, clean_a, token_slots), clean_b.float(), token_slots, y, slices)
    lora_kernel.lora_delta(x, token_slots, a, *args, y)
    torch.testing.assert_close(y, want, atol=2e-3, rtol=1e-4)


def test_c_kernel_refuses_what_does_not_fit(lora_kernel):
    gen = torch.Generator().manual_seed(7)
    a, _, tiles, lora_bias, _, _ = _c_case(gen, (32,), 16, [4, 4])
    x, slots = torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32)
    ranks = torch.tensor([4, 4])
    sl = lora_cpu.slice_array((32,))
    with pytest.raises(ValueError, match="lora_delta"):  # y wider than B's tiles
        lora_kernel.lora_delta(x, slots, a, ranks, tiles, sl, torch.zeros(3, 48))
    with pytest.raises(ValueError, match="lora_delta"):  # one token short
        lora_kernel.lora_delta(x, slots, a, ranks, tiles, sl, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="lora_delta"):  # int64 slots
        lora_kernel.lora_delta(x, slots.long(), a, ranks, tiles, sl, torch.zeros(3, 32))
    with pytest.raises(ValueError, match="lora_delta"):  # float32 x
        lora_kernel.lora_delta(x.float(), slots, a, ranks, tiles, sl, torch.zeros(3, 32))
    with pytest.raises(ValueError, match="lora_bias"):
        lora_kernel.lora_delta(x, slots, a, ranks, tiles, sl, torch.zeros(3, 32), lora_bias[:, :16])
    assert lora_kernel.accepts(x, torch.zeros(3, 32), a)
    assert not lora_kernel.accepts(x.float(), torch.zeros(3, 32), a)
    assert not lora_kernel.accepts(x, torch.zeros(3, 32), a.float())


def test_tile_b_layout():
    b = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    tiles = lora_cpu.tile_b(b)
    assert tiles.shape == (3, 3, 16) and tiles.is_contiguous()
    for o in range(40):
        assert torch.equal(tiles[o // 16, :, o % 16], b[o])
    assert not tiles[2, :, 8:].any()  # zero past the last row


def test_c_kernel_is_off_when_switched_off(monkeypatch):
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    assert lora_cpu.load() is None
    monkeypatch.delenv(cpu_ops.DISABLE_ENV)
    monkeypatch.setenv(cpu_ops.FORCE_NATIVE_ENV, "1")
    assert lora_cpu.load() is None
    monkeypatch.setenv("CC", "/no/such/cc")
    with pytest.raises(OSError, match="no C compiler"):
        lora_cpu.build()
