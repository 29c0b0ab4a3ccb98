"""aserve's C kernels for the CPU decode step (`aserve/kernels/cpu_ops.c`) against fp32 torch references.

Every check runs on three builds: this CPU's (`-march=native`: AVX512 / AVX512-BF16 paths where the
CPU has them) and the portable x86-64-v3 (AVX2) and x86-64-v2 (SSE) builds, so the code paths other
machines take are tested on any x86 CPU. Each result is fp32 inside with one rounding to bf16, so it
must equal the fp32 reference rounded once, up to a last-place difference on a few elements (fp32
summation order and fused multiply-adds).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from aserve.kernels import cpu_ops, reference
from tests.support.cpu_marches import MARCHES, build_cpu_kernels

BF16 = torch.bfloat16

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(scope="module", params=MARCHES)
def kernels(request) -> cpu_ops.CpuKernels:
    return build_cpu_kernels(request.param)


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def assert_rounded_once(got: torch.Tensor, want_fp32: torch.Tensor, exact_fraction: float = 0.98) -> None:
    """`got` (bf16) is `want_fp32` rounded to bf16, but for a few elements one bf16 step away."""
    assert got.dtype == BF16 and got.shape == want_fp32.shape
    rounded = want_fp32.to(BF16)
    step = rounded.float().abs().clamp_min(1e-30) * 2**-7  # one bf16 ulp, at most
    off = (got.float() - rounded.float()).abs()
    assert bool((off <= step + 1e-30).all()), f"max error {off.max().item()} beyond one bf16 step"
    assert (got == rounded).float().mean().item() >= exact_fraction


def int4_expected(kernels, x: torch.Tensor, weight_q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                  group_size: int = 32) -> torch.Tensor:
    """What `linear_int4` computes in fp32 (`w = q * scale + offset`, scale / offset exact in fp16): with bf16
    dot products, the exact product of x as given; with the AVX2 integer products, x rounded per 32 to 15-bit
    integers (`round(x * (16383 / max|x|))`, fp32, nearest even) times the codes, then scaled (cpu_matmul_avx2.c)."""
    scale_k, offset_k = scale.repeat_interleave(group_size, 1), offset.repeat_interleave(group_size, 1)
    if kernels.packed_isa != "avx2":
        return x.float() @ (weight_q.float() * scale_k + offset_k).T
    m, k = x.shape
    xg = x.float().reshape(m, k // 32, 32)
    amax = xg.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(16383.0) / amax, torch.zeros_like(amax))
    xq = (xg * inv).round() * (amax / torch.tensor(16383.0))  # fp32 steps as the kernel's
    return (xq.reshape(m, k).double() @ (weight_q.double() * scale_k.double()).T
            + x.double() @ offset_k.double().T).float()


def test_rms_norm_with_and_without_residual(kernels):
    x, residual = _rand(6, 64 * 3, seed=0)[:, :72], _rand(6, 72, seed=1)  # x rows strided
    weight = (1 + _rand(72, seed=2).float() * 0.3).to(BF16)
    def normed(s):
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float()

    out, summed = kernels.rms_norm(x, weight, 1e-5, residual)
    assert summed.dtype == torch.float32 and torch.equal(summed, x.float() + residual.float())  # not rounded
    assert_rounded_once(out, normed(summed))
    residual32 = torch.randn(6, 72, generator=torch.Generator().manual_seed(3))  # a float32 residual stream
    out, summed = kernels.rms_norm(x, weight, 1e-5, residual32)
    assert torch.equal(summed, x.float() + residual32)
    assert_rounded_once(out, normed(summed))
    x32 = x.float() + torch.randn(6, 72, generator=torch.Generator().manual_seed(4)) * 1e-3  # not bf16-exact
    out, summed = kernels.rms_norm(x32, weight, 1e-5, residual32)  # an unrounded projection output
    assert torch.equal(summed, x32 + residual32)
    assert_rounded_once(out, normed(summed))
    alone = kernels.rms_norm(x, weight, 1e-5)
    xf = x.float()
    assert_rounded_once(alone, xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.float())


@pytest.mark.parametrize("rotary_dim", [32, 16])  # 16 of 32: the rest passes through unchanged
def test_rotary_neox(kernels, rotary_dim):
    tokens, q_heads, k_heads, head_dim = 5, 4, 2, 32
    qkv = _rand(tokens, (q_heads + 2 * k_heads) * head_dim, seed=3)
    q, k, _ = qkv.split([q_heads * head_dim, k_heads * head_dim, k_heads * head_dim], dim=-1)
    q, k = q.view(tokens, q_heads, head_dim), k.view(tokens, k_heads, head_dim)  # strided, as the model passes
    angles = torch.rand(tokens, rotary_dim // 2, generator=torch.Generator().manual_seed(4)) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(BF16)
    q_out, k_out = kernels.rotary_neox(q, k, cos_sin)
    cos, sin = (c.float().unsqueeze(1) for c in cos_sin.chunk(2, -1))
    half = rotary_dim // 2
    for got, x in ((q_out, q), (k_out, k)):
        xf = x.float()
        a, b = xf[..., :half], xf[..., half:rotary_dim]
        want = torch.cat([a * cos - b * sin, b * cos + a * sin, xf[..., rotary_dim:]], -1)
        assert got.is_contiguous()
        assert_rounded_once(got, want)


def test_silu_and_mul(kernels):
    x = _rand(3, 2 * 96, seed=5, scale=3.0)
    xf = x.float()
    assert_rounded_once(kernels.silu_and_mul(x), F.silu(xf[:, :96]) * xf[:, 96:])
    x32 = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(6)) * 3  # float32 rows: bf16 out
    assert_rounded_once(kernels.silu_and_mul(x32), F.silu(x32[:, :96]) * x32[:, 96:])


def test_gelu_tanh_and_mul(kernels):
    """Against float64 in the form a * sigmoid(2y), equal to gelu_tanh(a) = a (1 + tanh(y)) / 2: torch's
    tanh form loses relative precision where gelu nears 0 (1 + tanh(y) cancels; in float64 too, to an
    exact 0 below a ~ -8), the kernel's 1 / (1 + exp(-2y)) does not; torch's agrees in absolute terms."""
    def want(x: torch.Tensor) -> torch.Tensor:
        a, b = x.double()[:, :96], x.double()[:, 96:]
        y = 0.7978845608028654 * (a + 0.044715 * a**3)
        torch.testing.assert_close(a * torch.sigmoid(2 * y), F.gelu(a, approximate="tanh"), rtol=1e-6, atol=1e-12)
        return (a * torch.sigmoid(2 * y) * b).float()

    x = _rand(5, 2 * 96, seed=7, scale=3.0)
    assert_rounded_once(kernels.gelu_tanh_and_mul(x), want(x))
    x32 = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(8)) * 4  # float32 rows: bf16 out
    assert_rounded_once(kernels.gelu_tanh_and_mul(x32), want(x32))


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
@pytest.mark.parametrize("in_features", [64, 40])  # 40: not a multiple of 32 (the portable loop)
def test_linear(kernels, rows, in_features):
    x = _rand(rows, in_features * 2, seed=6)[:, :in_features]  # strided rows
    weight, bias = _rand(37, in_features, seed=7, scale=0.2), _rand(37, seed=8)
    want = x.float() @ weight.float().T
    assert_rounded_once(kernels.linear(x, weight), want, exact_fraction=0.95)
    assert_rounded_once(kernels.linear(x, weight, bias), want + bias.float(), exact_fraction=0.95)
    logits = kernels.linear(x, weight, None, torch.float32)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 13])  # register blocks of 6 rows: full, partial, several
def test_linear_vnni(kernels, rows):
    weight, bias = _rand(80, 64, seed=15, scale=0.2), _rand(80, seed=16)  # 80 columns: 64 + a group of 16
    packed = kernels.pack_vnni(weight)
    assert packed.shape == (5, 32, 16, 2) and kernels.pack_vnni(weight[:40]) is None
    x = _rand(rows, 128, seed=17)[:, :64]  # strided rows
    if not kernels.packed_matmuls:
        with pytest.raises(RuntimeError, match="no packed matrix products"):
            kernels.linear_vnni(x, packed)
        return
    want = x.float() @ weight.float().T + bias.float()
    assert_rounded_once(kernels.linear_vnni(x, packed, bias), want, exact_fraction=0.95)
    torch.testing.assert_close(kernels.linear_vnni(x, packed, bias, torch.float32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("in_features", [576, 70])  # 70: an odd count of k-pairs (the one-row tail)
def test_linear_vnni_one_row_sums_as_in_a_batch(kernels, in_features):
    """A decode step's single row has its own loop (more weight loads in flight) with the batch's order of
    sums: each row is bitwise the same alone or among others."""
    if not kernels.packed_matmuls:
        pytest.skip("no packed products in this build (AVX512-BF16 or AVX2)")
    weight, bias = _rand(336, in_features, seed=24, scale=0.2), _rand(336, seed=25)
    packed, x = kernels.pack_vnni(weight), _rand(7, in_features, seed=26)
    for dtype in (torch.float32, torch.bfloat16):
        batch = kernels.linear_vnni(x, packed, bias, dtype)
        alone = torch.cat([kernels.linear_vnni(x[i:i + 1], packed, bias, dtype) for i in range(7)])
        assert torch.equal(alone, batch)
    torch.testing.assert_close(batch.float(), x.float() @ weight.float().T + bias.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 7])
def test_products_split_among_threads_cover_every_column_once(kernels, threads, rows):
    """Past the parallel threshold the threads share the columns (each its own range, then stealing from
    the back of the others'); with any team size, every column is computed once and right. Below the
    threshold (the small tests above) one thread takes every range."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        weight = _rand(336, 256, seed=21, scale=0.2)  # 21 groups of 16 columns: ranges of unequal chunks
        x = _rand(rows, 256, seed=22)
        want = x.float() @ weight.float().T
        torch.testing.assert_close(kernels.linear(x, weight, None, torch.float32), want, rtol=1e-5, atol=1e-5)
        if not kernels.packed_matmuls:
            return  # no packed products in this build (neither AVX512-BF16 nor AVX2)
        torch.testing.assert_close(kernels.linear_vnni(x, kernels.pack_vnni(weight), None, torch.float32), want,
                                   rtol=1e-5, atol=1e-5)
        gen = torch.Generator().manual_seed(23)
        q = torch.randint(0, 16, (336, 256), generator=gen, dtype=torch.uint8)
        scale = (torch.rand(336, 8, generator=gen) * 0.1).half().float()
        offset = (torch.randn(336, 8, generator=gen) * 0.1).half().float()
        torch.testing.assert_close(kernels.linear_int4(x, kernels.pack_int4(q, scale, offset), None, torch.float32),
                                   int4_expected(kernels, x, q, scale, offset), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])  # blocks: 1-2 rows x 64 columns, 4 rows x 32
def test_linear_int4(kernels, rows):
    gen = torch.Generator().manual_seed(18)
    q = torch.randint(0, 16, (48, 96), generator=gen, dtype=torch.uint8)
    scale, offset = torch.rand(48, 3, generator=gen) * 0.1, torch.randn(48, 3, generator=gen) * 0.1
    assert kernels.pack_int4(q, scale, offset) is None  # scales must be exact in fp16 (GGUF's are)
    scale, offset = scale.half().float(), offset.half().float()
    packed = kernels.pack_int4(q, scale, offset)
    assert packed[0].shape == (3, 24, 32) and kernels.pack_int4(q[:40], scale[:40], offset[:40]) is None
    weight = q.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    x, bias = _rand(rows, 192, seed=19)[:, :96], _rand(48, seed=20)  # strided rows
    if not kernels.packed_matmuls:
        with pytest.raises(RuntimeError, match="no packed matrix products"):
            kernels.linear_int4(x, packed)
        return
    want = int4_expected(kernels, x, q, scale, offset) + bias.float()
    torch.testing.assert_close(kernels.linear_int4(x, packed, bias, torch.float32), want, rtol=1e-5, atol=1e-4)
    assert_rounded_once(kernels.linear_int4(x, packed, bias), want, exact_fraction=0.95)
    # x's 15-bit rounding (AVX2) stays far inside bf16's own rounding of x
    torch.testing.assert_close(want, x.float() @ weight.T + bias.float(), rtol=1e-3, atol=2e-3)


def test_linear_int4_one_row_sums_as_in_a_batch(kernels):
    """A row's result does not depend on the rows beside it (a request's tokens do not depend on the batch)."""
    if not kernels.packed_matmuls:
        pytest.skip("no packed products in this build")
    gen = torch.Generator().manual_seed(24)
    q = torch.randint(0, 16, (64, 576), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(64, 18, generator=gen) * 0.1).half().float()
    offset = (torch.randn(64, 18, generator=gen) * 0.1).half().float()
    packed = kernels.pack_int4(q, scale, offset)
    x = _rand(7, 576, seed=25)
    batch = kernels.linear_int4(x, packed, None, torch.float32)
    for i in (0, 3, 6):
        assert torch.equal(kernels.linear_int4(x[i:i + 1], packed, None, torch.float32), batch[i:i + 1])


@pytest.mark.parametrize("group_size", [64, 128])
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_linear_int4_wider_groups(kernels, rows, group_size):
    """One scale / offset per `group_size` columns (GPTQ / AWQ groups as they are), against the reference."""
    gen = torch.Generator().manual_seed(21)
    n, k = 32, 256
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group_size, generator=gen) * 0.1 + 0.01
    offset = torch.randn(n, k // group_size, generator=gen) * 0.1
    assert kernels.pack_int4(q, scale, offset, group_size) is None  # not exact in fp16
    packed = kernels.pack_int4(q, scale, offset, group_size, exact=False)  # rounded to fp16
    assert packed[1].shape == (n // 16, k // group_size, 16)
    assert kernels.pack_int4(q, scale, offset, 48, exact=False) is None  # not a multiple of 32
    x = _rand(rows, k, seed=22)
    if not kernels.packed_matmuls:
        return
    want = int4_expected(kernels, x, q, scale.half().float(), offset.half().float(), group_size)
    torch.testing.assert_close(kernels.linear_int4(x, packed, None, torch.float32), want, rtol=1e-5, atol=1e-4)
    narrow = kernels.pack_int4(q, scale.half().float().repeat_interleave(group_size // 32, 1),
                               offset.half().float().repeat_interleave(group_size // 32, 1))
    torch.testing.assert_close(kernels.linear_int4(x, packed, None, torch.float32),
                               kernels.linear_int4(x, narrow, None, torch.float32), rtol=1e-5, atol=1e-4)


def _reference_decode(q, kv_cache, block_tables, seq_lens, scale, window, softcap=None):
    """fp32 SDPA over each sequence's gathered keys / values (the last `window` of them when set);
    with `softcap`, aserve's reference capped attention."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    outs = []
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        blocks = block_tables[b, : -(-length // block_size)].long()
        keys, values = (kv_cache[i][blocks].reshape(-1, num_kv_heads, head_dim)[:length].float() for i in (0, 1))
        start = max(0, length - window) if window else 0
        keys, values = keys[start:], values[start:]
        group = q.shape[1] // num_kv_heads
        query = q[b].float().view(num_kv_heads, group, head_dim)
        if softcap is None:
            out = F.scaled_dot_product_attention(query, keys.transpose(0, 1), values.transpose(0, 1), scale=scale)
        else:
            out = reference.softcapped_attention(query, keys.transpose(0, 1), values.transpose(0, 1), None, scale,
                                                 softcap)
        outs.append(out.reshape(-1, head_dim))
    return torch.stack(outs)


# (16, 1, 96) and (10, 2, 256): the bf16-dot path with a generic head size, a full block of 4 heads and a rest
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (16, 1, 80), (6, 2, 40), (16, 1, 96),
                                                    (10, 2, 256)])
@pytest.mark.parametrize("window", [None, 21])
def test_paged_decode_attention(kernels, heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(9)
    num_blocks, block_size = 40, 16
    kv_cache = _rand(2, num_blocks, block_size, kv_heads, head_dim, seed=10)
    seq_lens = torch.tensor([1, 37, 100, 130], dtype=torch.int32)  # 130 > 2 key chunks of 64
    block_tables = torch.randperm(num_blocks, generator=gen)[:4 * 9].view(4, 9).to(torch.int32)
    q = _rand(4, heads, head_dim, seed=11)
    got = kernels.paged_decode_attention(q, kv_cache, block_tables, seq_lens, head_dim**-0.5, window)
    want = _reference_decode(q, kv_cache, block_tables, seq_lens, head_dim**-0.5, window)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("heads,kv_heads,head_dim,lengths,window,softcap", [
    (9, 3, 64, [300], None, None),  # one sequence: its keys run in splits over the threads, then merged
    (9, 3, 64, [1000, 5], 700, None),  # a window past the first split, and a sequence too short to split
    (4, 1, 128, [517], None, 2.0),  # one KV head, 5 splits' worth of keys, capped scores
    (16, 1, 96, [260], None, None)])  # a generic head size
def test_paged_decode_attention_splits_a_small_batchs_keys_across_threads(kernels, heads, kv_heads, head_dim,
                                                                         lengths, window, softcap):
    """A small batch with many keys: runs of keys on every thread, merged by their softmax states (checked
    with 4 threads, whatever the machine has). The AVX2 form splits the same way on any thread count (its
    result is bitwise the one-thread one); the bf16 dot-product form splits over the threads."""
    if kernels.attention_isa is None:
        pytest.skip("the portable decode attention does not split")
    gen = torch.Generator().manual_seed(29)
    block_size = 16
    per_seq = -(-max(lengths) // block_size)
    num_blocks = per_seq * len(lengths) + 3
    kv_cache = _rand(2, num_blocks, block_size, kv_heads, head_dim, seed=30)
    block_tables = torch.randperm(num_blocks, generator=gen)[:per_seq * len(lengths)].view(len(lengths), per_seq)
    block_tables = block_tables.to(torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q = _rand(len(lengths), heads, head_dim, seed=31, scale=3.0)  # peaked scores: each split's max matters
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        got = kernels.paged_decode_attention(q, kv_cache, block_tables, seq_lens, head_dim**-0.5, window,
                                             softcap=softcap)
        torch.set_num_threads(1)  # one thread: no split
        single = kernels.paged_decode_attention(q, kv_cache, block_tables, seq_lens, head_dim**-0.5, window,
                                                softcap=softcap)
    finally:
        torch.set_num_threads(threads)
    want = _reference_decode(q, kv_cache, block_tables, seq_lens, head_dim**-0.5, window, softcap)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), single.float(), atol=8e-3, rtol=8e-3)
    if kernels.attention_isa == "avx2":
        assert torch.equal(got, single)


@pytest.mark.parametrize("softcap", [0.3, 2.0])
def test_paged_decode_attention_with_a_logit_softcap(kernels, softcap):
    gen = torch.Generator().manual_seed(19)
    kv_cache = _rand(2, 40, 16, 2, 64, seed=20)
    seq_lens = torch.tensor([5, 130], dtype=torch.int32)
    block_tables = torch.randperm(40, generator=gen)[:18].view(2, 9).to(torch.int32)
    q = _rand(2, 8, 64, seed=21, scale=4.0)  # scores well past the cap
    got = kernels.paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.125, 21, softcap=softcap)
    want = _reference_decode(q, kv_cache, block_tables, seq_lens, 0.125, 21, softcap)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    uncapped = _reference_decode(q, kv_cache, block_tables, seq_lens, 0.125, 21)
    assert not torch.allclose(want, uncapped, atol=5e-2)


def test_rms_norm_weight_offset_is_gemmas_one_plus_w(kernels):
    x, residual = _rand(5, 64, seed=22), _rand(5, 64, seed=23)
    weight = (_rand(64, seed=24).float() * 0.05).to(BF16)  # zero-centred, as Gemma stores it
    out, summed = kernels.rms_norm(x, weight, 1e-6, residual, weight_offset=1.0)
    want = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())
    assert_rounded_once(out, want)


def test_paged_decode_attention_writes_new_keys_first_and_skips_minus_one_slots(kernels):
    num_blocks, block_size, kv_heads, head_dim = 8, 4, 2, 64
    kv_cache = _rand(2, num_blocks, block_size, kv_heads, head_dim, seed=12)
    before = kv_cache.clone()
    block_tables = torch.tensor([[3, 5], [6, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 3], dtype=torch.int32)
    slots = torch.tensor([5 * block_size + 1, -1])  # sequence 0 writes its 6th key; sequence 1 is skipped
    kv = _rand(2, 2, kv_heads * 2 * head_dim, seed=13)  # k and v views with strided tokens
    k, v = (kv[i][:, :kv_heads * head_dim].view(2, kv_heads, head_dim) for i in (0, 1))
    q = _rand(2, 4, head_dim, seed=14)
    got = kernels.paged_decode_attention(q, kv_cache, block_tables, seq_lens, 0.125, None, (k, v, slots))
    flat = kv_cache.view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat[0, 5 * block_size + 1], k[0]) and torch.equal(flat[1, 5 * block_size + 1], v[0])
    changed = (kv_cache != before).view(2, num_blocks * block_size, -1).any(-1)  # per slot
    assert changed.nonzero()[:, 1].tolist() == [5 * block_size + 1] * 2  # that slot only, keys and values
    torch.testing.assert_close(got.float(), _reference_decode(q, kv_cache, block_tables, seq_lens, 0.125, None),
                               atol=1e-2, rtol=1e-2)


def test_load_is_off_when_switched_off(monkeypatch):
    monkeypatch.setenv(cpu_ops.DISABLE_ENV, "0")
    assert cpu_ops.load() is None
    monkeypatch.delenv(cpu_ops.DISABLE_ENV)
    monkeypatch.setenv(cpu_ops.FORCE_NATIVE_ENV, "1")
    assert cpu_ops.load() is None
    monkeypatch.delenv(cpu_ops.FORCE_NATIVE_ENV)
    assert isinstance(cpu_ops.load(), cpu_ops.CpuKernels)


def test_build_failure_is_reported_not_swallowed(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(OSError, match="no C compiler"):
        cpu_ops.build()


def test_kernels_refuse_what_they_cannot_take(kernels):
    assert not kernels.accepts(torch.zeros(2, 4))  # float32
    assert not kernels.accepts(torch.zeros(4, 2, dtype=BF16).t())  # no unit stride
    assert kernels.accepts(torch.zeros(2, 4, dtype=BF16), torch.zeros(4, dtype=BF16))
    with pytest.raises(ValueError, match="linear"):
        kernels.linear(torch.zeros(2, 4, dtype=BF16), torch.zeros(3, 5, dtype=BF16))
    with pytest.raises(ValueError, match="paged_decode_attention"):
        kernels.paged_decode_attention(torch.zeros(1, 5, 8, dtype=BF16), torch.zeros(2, 1, 4, 2, 8, dtype=BF16),
                                       torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
