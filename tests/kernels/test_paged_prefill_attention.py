"""paged_prefill_attention against the torch reference: fresh prefill, chunked prefill, prefix hits."""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import reference
from aserve.kernels.paged_prefill_attention import paged_prefill_attention


def _packed_queries(q_lens, num_heads, head_dim, dtype, device, gen):
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype).to(device)
    return q, starts, torch.tensor(starts, dtype=torch.int32, device=device)


def _run(case, q, starts, qsl, scale, **kwargs):
    kwargs.setdefault("query_start_loc_cpu", starts)
    got = paged_prefill_attention(q, case.kv_cache, case.block_tables, qsl, case.seq_lens, scale, **kwargs)
    kwargs.pop("max_query_len", None)
    kwargs["query_start_loc_cpu"] = starts
    want = reference.paged_prefill_attention(
        q, case.kv_cache, case.block_tables, qsl, case.seq_lens, scale, **kwargs
    )
    return got, want


def _close(got, want, dtype):
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (block_size, head_dim, num_heads, num_kv_heads, q_lens, cached_lens, dtype)
SHAPES = [
    pytest.param(16, 64, 4, 2, [5, 12, 1], [0, 0, 0], torch.float32, id="fresh-bs16-d64-gqa2"),
    pytest.param(8, 80, 4, 1, [7, 3], [13, 30], torch.float32, id="prefix-bs8-d80-mqa"),
    pytest.param(32, 96, 2, 2, [20, 1, 9], [40, 17, 0], torch.float16, id="mixed-bs32-d96-fp16"),
    pytest.param(128, 128, 2, 1, [70], [5], torch.float32, id="two-m-tiles-bs128-d128"),
    pytest.param(64, 256, 2, 2, [9, 4], [64, 0], torch.float16, id="bs64-d256-fp16"),
]


@pytest.mark.parametrize("block_size, head_dim, num_heads, num_kv_heads, q_lens, cached_lens, dtype", SHAPES)
def test_matches_reference(
    paged_case, device, gen, block_size, head_dim, num_heads, num_kv_heads, q_lens, cached_lens, dtype
):
    seq_lens = [a + b for a, b in zip(q_lens, cached_lens)]
    case = paged_case(seq_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q, starts, qsl = _packed_queries(q_lens, num_heads, head_dim, dtype, device, gen)
    got, want = _run(case, q, starts, qsl, head_dim**-0.5)
    assert got.shape == q.shape and got.dtype == dtype
    _close(got, want, dtype)


@pytest.mark.parametrize("window", [1, 4, 16, 100])
def test_sliding_window_with_prefix(paged_case, device, gen, window):
    q_lens, cached = [6, 20], [25, 3]
    case = paged_case([a + b for a, b in zip(q_lens, cached)], 8, 1, 64, torch.float32, device, gen)
    q, starts, qsl = _packed_queries(q_lens, 2, 64, torch.float32, device, gen)
    got, want = _run(case, q, starts, qsl, 0.125, sliding_window=window)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_cache_with_scales(paged_case, device, gen, cache_dtype):
    q_lens, cached = [5, 3], [11, 0]
    case = paged_case([a + b for a, b in zip(q_lens, cached)], 16, 1, 64, cache_dtype, device, gen, scale=2.0)
    q, starts, qsl = _packed_queries(q_lens, 2, 64, torch.float32, device, gen)
    got, want = _run(case, q, starts, qsl, 0.125, k_scale=2.0, v_scale=2.0)
    _close(got, want, torch.float32)


@pytest.mark.parametrize("host_info", ["none", "max_query_len"])
def test_grid_size_without_host_lists(paged_case, device, gen, host_info):
    case = paged_case([4, 10], 16, 2, 64, torch.float32, device, gen)
    q, starts, qsl = _packed_queries([4, 2], 2, 64, torch.float32, device, gen)
    extra = {"query_start_loc_cpu": None}
    if host_info == "max_query_len":
        extra["max_query_len"] = 4
    got, want = _run(case, q, starts, qsl, 0.125, **extra)
    _close(got, want, torch.float32)


def test_strided_q_and_out_slice(paged_case, device, gen):
    case = paged_case([9, 5], 8, 1, 64, torch.float32, device, gen)
    _, starts, qsl = _packed_queries([3, 5], 2, 64, torch.float32, device, gen)
    qkv = torch.randn(8, 4, 64, generator=gen).to(device)
    q = qkv[:, :2]
    full = torch.full((10, 2, 64), 7.0, device=device)
    got = paged_prefill_attention(
        q,
        case.kv_cache,
        case.block_tables,
        qsl,
        case.seq_lens,
        0.125,
        query_start_loc_cpu=starts,
        out=full[:8],
    )
    assert got.data_ptr() == full.data_ptr()
    want = reference.paged_prefill_attention(q, case.kv_cache, case.block_tables, qsl, case.seq_lens, 0.125)
    _close(full[:8], want, torch.float32)
    assert torch.all(full[8:] == 7.0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"qsl": lambda qsl: qsl[:2]}, "query_start_loc: expected 3"),
        ({"qsl": lambda qsl: qsl.long()}, "query_start_loc: dtype"),
        ({"kw": {"v_scale": 0.5}}, "v_scale"),
        ({"kw": {"sliding_window": -3}}, "sliding_window"),
        ({"kw": {"query_start_loc_cpu": [0, 1]}}, "query_start_loc_cpu"),
    ],
    ids=["qsl-len", "qsl-dtype", "scale", "window", "host-qsl"],
)
def test_bad_input_names_the_argument(paged_case, device, gen, change, match):
    case = paged_case([4, 6], 8, 1, 64, torch.float32, device, gen)
    q, _starts, qsl = _packed_queries([2, 3], 2, 64, torch.float32, device, gen)
    if "qsl" in change:
        qsl = change["qsl"](qsl)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(
            q, case.kv_cache, case.block_tables, qsl, case.seq_lens, 0.125, **change.get("kw", {})
        )


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 64])
def test_bf16_long_chunks_on_gpu(paged_case, gen, window):
    device = torch.device("cuda")
    q_lens, cached = [300, 1, 77], [0, 500, 1200]
    case = paged_case([a + b for a, b in zip(q_lens, cached)], 16, 2, 128, torch.bfloat16, device, gen)
    q, starts, qsl = _packed_queries(q_lens, 8, 128, torch.bfloat16, device, gen)
    got, want = _run(case, q, starts, qsl, 128**-0.5, sliding_window=window)
    _close(got, want, torch.bfloat16)
