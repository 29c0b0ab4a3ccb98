"""reshape_and_cache against the torch reference: exact bytes, skipped slots, fp8 storage."""

from __future__ import annotations

import pytest
import torch
from aserve.kernels import reference
from aserve.kernels.reshape_and_cache import reshape_and_cache

FP8 = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


def _cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
    # A recognizable fill, so untouched slots can be checked too.
    return torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), 3.0).to(dtype).to(device)


def _slots(num_tokens, num_blocks, block_size, gen, device, skip=()):
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    for i in skip:
        slots[i] = -1
    return slots.to(device)


def _write_both(key, value, cache, slots, k_scale=1.0, v_scale=1.0):
    got, want = cache.clone(), cache.clone()
    reshape_and_cache(key, value, got, slots, k_scale, v_scale)
    reference.reshape_and_cache(key, value, want, slots, k_scale, v_scale)
    return got, want


def _same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize(
    "block_size, num_kv_heads, head_dim, dtype",
    [
        (8, 1, 64, torch.float32),
        (16, 3, 80, torch.float16),
        (128, 2, 96, torch.bfloat16),
        (32, 8, 256, torch.float32),
    ],
    ids=["bs8-mqa", "bs16-kvh3-d80-fp16", "bs128-d96-bf16", "bs32-kvh8-d256"],
)
def test_matches_reference_exactly(device, gen, block_size, num_kv_heads, head_dim, dtype):
    key = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(6, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    cache = _cache(4, block_size, num_kv_heads, head_dim, dtype, device)
    slots = _slots(6, 4, block_size, gen, device, skip=(2, 5))
    got, want = _write_both(key, value, cache, slots)
    assert _same_bytes(got, want)
    # the skipped tokens were written nowhere: exactly 4 tokens' worth of slots changed per K and V
    changed = (got != cache).any(dim=(3, 4))
    assert int(changed.sum()) == 2 * 4


def test_int32_slots_and_strided_inputs(device, gen):
    """key/value may be views into a fused qkv buffer; slots may be int32."""
    qkv = torch.randn(5, 8, 64, generator=gen).to(device)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    cache = _cache(3, 16, 2, 64, torch.float32, device)
    slots = _slots(5, 3, 16, gen, device)
    got, want = _write_both(key, value, cache, slots.to(torch.int32))
    assert _same_bytes(got, want)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("k_scale, v_scale", [(1.0, 1.0), (0.5, 4.0)])
def test_fp8_exactly_representable_values(device, gen, cache_dtype, k_scale, v_scale):
    """Values that are fp8 numbers times the scale need no rounding, so every backend (the
    interpreter included, whose fp32->fp8 rounding is wrong) must store exactly torch's bytes."""
    key = (torch.randn(7, 2, 64, generator=gen) * 4).to(cache_dtype).float() * k_scale
    value = (torch.randn(7, 2, 64, generator=gen) * 4).to(cache_dtype).float() * v_scale
    cache = _cache(3, 8, 2, 64, cache_dtype, device)
    slots = _slots(7, 3, 8, gen, device, skip=(0,))
    got, want = _write_both(key.to(device), value.to(device), cache, slots, k_scale, v_scale)
    assert _same_bytes(got, want)
    # and reading back with the scales recovers the inputs exactly
    k_back = got[0].view(-1, 2, 64)[slots[1:].long()].float() * k_scale
    torch.testing.assert_close(k_back, key[1:].to(device), atol=0, rtol=0)


def test_fp8_e4m3_saturates_like_torch(device):
    key = torch.tensor([1000.0, -1000.0, 448.0, 0.0]).repeat(16).view(1, 1, 64).to(device)
    cache = _cache(1, 8, 1, 64, torch.float8_e4m3fn, device)
    got, want = _write_both(key, key, cache, torch.tensor([3], device=device))
    assert _same_bytes(got, want)
    assert got[0, 0, 3, 0, :4].float().tolist() == [448.0, -448.0, 448.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k_scale": 2.0}, "k_scale"),
        ({"slot_mapping": torch.zeros(3, dtype=torch.int64)}, "slot_mapping: expected 4"),
        ({"value": torch.zeros(4, 1, 32)}, "value: shape"),
        ({"key": torch.zeros(4, 2, 64)}, "key: expected"),
        ({"slot_mapping": torch.zeros(4)}, "slot_mapping: dtype"),
    ],
    ids=["scale-on-unquantized", "slots-len", "value-shape", "key-heads", "slot-dtype"],
)
def test_bad_input_names_the_argument(kwargs, match):
    args = {
        "key": torch.zeros(4, 1, 64), "value": torch.zeros(4, 1, 64), "kv_cache": torch.zeros(2, 2, 8, 1, 64),
        "slot_mapping": torch.arange(4),
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        reshape_and_cache(**args)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_rounding_matches_torch_on_gpu(gen, cache_dtype, src_dtype):
    device = torch.device("cuda")
    key = (torch.randn(64, 4, 128, generator=gen) * 3).to(src_dtype).to(device)
    value = (torch.randn(64, 4, 128, generator=gen) * 3).to(src_dtype).to(device)
    cache = _cache(8, 16, 4, 128, cache_dtype, device)
    slots = _slots(64, 8, 16, gen, device)
    got, want = _write_both(key, value, cache, slots, 0.75, 1.5)
    assert _same_bytes(got, want)
    # round trip within fp8's relative precision (e4m3: 2^-4, e5m2: 2^-3, half an ulp each)
    rel = 2**-4 if cache_dtype == torch.float8_e4m3fn else 2**-3
    back = got[0].view(-1, 4, 128)[slots].float() * 0.75
    torch.testing.assert_close(back, key.float(), rtol=rel, atol=0.75 * 2**-9)
