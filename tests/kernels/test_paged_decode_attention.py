"""paged_decode_attention against the torch reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import reference
from aserve.kernels.paged_decode_attention import (
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    paged_decode_attention,
)


def _run(case, q, scale, **kwargs):
    got = paged_decode_attention(q, case.kv_cache, case.block_tables, case.seq_lens, scale, **kwargs)
    kwargs.pop("num_splits", None)
    want = reference.paged_decode_attention(
        q, case.kv_cache, case.block_tables, case.seq_lens, scale, **kwargs
    )
    return got, want


def _close(got, want, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (block_size, head_dim, num_heads, num_kv_heads, seq_lens, dtype)
SHAPES = [
    pytest.param(8, 64, 4, 4, [1, 9, 30], torch.float32, id="bs8-d64-mha"),
    pytest.param(16, 80, 8, 2, [17, 5, 64], torch.float32, id="bs16-d80-gqa4"),
    pytest.param(32, 96, 4, 1, [33, 2], torch.float16, id="bs32-d96-mqa-fp16"),
    pytest.param(128, 128, 2, 1, [130, 7], torch.float32, id="bs128-d128-mqa"),
    pytest.param(64, 256, 2, 2, [40, 1], torch.float16, id="bs64-d256-fp16"),
    pytest.param(16, 64, 32, 1, [20, 3], torch.float32, id="bs16-d64-group32"),
]


@pytest.mark.parametrize("block_size, head_dim, num_heads, num_kv_heads, seq_lens, dtype", SHAPES)
def test_matches_reference(
    paged_case, device, gen, block_size, head_dim, num_heads, num_kv_heads, seq_lens, dtype
):
    case = paged_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    got, want = _run(case, q, head_dim**-0.5, num_splits=1)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_context_matches_reference(paged_case, device, gen, num_splits):
    # seq 0 is shorter than the split count: most of its splits are empty.
    seq_lens = [3, 70, 129]
    case = paged_case(seq_lens, 16, 2, 64, torch.float32, device, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(device)
    got, want = _run(case, q, 0.125, num_splits=num_splits)
    _close(got, want, torch.float32)


@pytest.mark.parametrize(
    "window, num_splits", [(1, 1), (5, 1), (40, 1), (200, 1), (5, 3), (40, 4)], ids=lambda v: str(v)
)
def test_sliding_window(paged_case, device, gen, window, num_splits):
    seq_lens = [4, 37, 90]
    case = paged_case(seq_lens, 8, 1, 64, torch.float32, device, gen)
    q = torch.randn(3, 2, 64, generator=gen).to(device)
    got, want = _run(case, q, 0.125, sliding_window=window, num_splits=num_splits)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_cache_with_scales(paged_case, device, gen, cache_dtype, num_splits):
    # The cache is quantized by torch; the kernel's part is reading and rescaling it exactly.
    k_scale = v_scale = 0.5
    case = paged_case([20, 45], 16, 2, 64, cache_dtype, device, gen, scale=k_scale)
    q = torch.randn(2, 4, 64, generator=gen).to(device)
    got, want = _run(case, q, 0.125, k_scale=k_scale, v_scale=v_scale, num_splits=num_splits)
    _close(got, want, torch.float32)


def test_distinct_k_and_v_scales(paged_case, device, gen):
    case = paged_case([33], 16, 1, 64, torch.float8_e4m3fn, device, gen)
    q = torch.randn(1, 2, 64, generator=gen).to(device)
    got, want = _run(case, q, 0.125, k_scale=0.25, v_scale=4.0, num_splits=1)
    _close(got, want, torch.float32)


def test_strided_q_and_out_slice(paged_case, device, gen):
    """q may be a view into a fused qkv buffer; `out` may be a slice of a larger output."""
    case = paged_case([12, 25], 8, 2, 64, torch.float32, device, gen)
    qkv = torch.randn(2, 6, 64, generator=gen).to(device)
    q = qkv[:, :4]
    full = torch.full((3, 4, 64), 7.0, device=device)
    got = paged_decode_attention(q, case.kv_cache, case.block_tables, case.seq_lens, 0.125, out=full[:2])
    assert got.data_ptr() == full.data_ptr()
    want = reference.paged_decode_attention(q, case.kv_cache, case.block_tables, case.seq_lens, 0.125)
    _close(full[:2], want, torch.float32)
    assert torch.all(full[2] == 7.0)


def test_zero_length_sequence_gives_zeros(paged_case, device, gen):
    """A padded batch entry (seq_len 0) must not produce NaNs."""
    case = paged_case([9, 1], 8, 1, 64, torch.float32, device, gen)
    seq_lens = torch.tensor([9, 0], dtype=torch.int32, device=device)
    q = torch.randn(2, 2, 64, generator=gen).to(device)
    for num_splits in (1, 2):
        got = paged_decode_attention(
            q, case.kv_cache, case.block_tables, seq_lens, 0.125, num_splits=num_splits
        )
        assert torch.all(got[1] == 0)
        want = reference.paged_decode_attention(
            q[:1], case.kv_cache, case.block_tables[:1], seq_lens[:1], 0.125
        )
        _close(got[:1], want, torch.float32)


def test_choose_num_splits():
    assert choose_num_splits(num_programs=4, max_context=MIN_TOKENS_PER_SPLIT - 1, num_sms=132) == 1
    assert choose_num_splits(num_programs=1024, max_context=32768, num_sms=132) == 1
    long_few = choose_num_splits(num_programs=8, max_context=32768, num_sms=132)
    assert 1 < long_few <= MAX_SPLITS
    assert choose_num_splits(num_programs=1, max_context=10**7, num_sms=132) == MAX_SPLITS
    # each split keeps at least MIN_TOKENS_PER_SPLIT tokens
    assert choose_num_splits(num_programs=1, max_context=3 * MIN_TOKENS_PER_SPLIT, num_sms=132) == 3


@pytest.mark.parametrize(
    "change, match",
    [
        ({"q": lambda c, q: q.to(torch.int32)}, "q: dtype"),
        ({"q": lambda c, q: q[:, :3]}, "num_heads 3 is not a multiple"),
        ({"q": lambda c, q: q[..., :32]}, "head_dim"),
        ({"block_tables": lambda c, q: c.block_tables.long()}, "block_tables: dtype"),
        ({"seq_lens": lambda c, q: c.seq_lens[:1]}, "seq_lens"),
        ({"kw": {"k_scale": 2.0}}, "k_scale"),
        ({"kw": {"sliding_window": 0}}, "sliding_window"),
        ({"kw": {"num_splits": 0}}, "num_splits"),
        ({"kv_cache": lambda c, q: c.kv_cache.half()}, "kv_cache: dtype"),
    ],
    ids=["q-dtype", "gqa", "head-dim", "table-dtype", "batch", "scale", "window", "splits", "cache-dtype"],
)
def test_bad_input_names_the_argument(paged_case, device, gen, change, match):
    case = paged_case([5, 9], 8, 2, 64, torch.float32, device, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(device)
    args = {"q": q, "kv_cache": case.kv_cache, "block_tables": case.block_tables, "seq_lens": case.seq_lens}
    for name in ("q", "kv_cache", "block_tables", "seq_lens"):
        if name in change:
            args[name] = change[name](case, q)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(scale=0.125, **args, **change.get("kw", {}))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_bf16_on_gpu(paged_case, gen, num_splits):
    device = torch.device("cuda")
    case = paged_case([1, 200, 1000], 16, 2, 128, torch.bfloat16, device, gen)
    q = torch.randn(3, 8, 128, generator=gen).to(torch.bfloat16).to(device)
    got, want = _run(case, q, 128**-0.5, num_splits=num_splits)
    _close(got, want, torch.bfloat16)


@pytest.mark.gpu
def test_auto_split_long_context_on_gpu(paged_case, gen):
    device = torch.device("cuda")
    case = paged_case([4000, 17], 32, 1, 128, torch.float16, device, gen)
    q = torch.randn(2, 4, 128, generator=gen).half().to(device)
    got, want = _run(case, q, 128**-0.5)
    _close(got, want, torch.float16)
