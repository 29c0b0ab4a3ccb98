"""fp8 KV-cache scales per attention layer (aserve/model/kv_scales.py): each layer's own k_scale / v_scale
reach the cache it writes (`fp8(k / k_scale)`) and the reads that multiply them back, on every path
(planned steps of the torch and triton backends, the compiled decode's `DecodeInputs`); and
`--calculate-kv-scales` computes them from the first step, then keeps them."""

from __future__ import annotations

import pytest
import torch

from aserve.model.attention.torch_backend import TorchAttentionBackend, decode_inputs
from aserve.model.attention.triton_backend import TritonAttentionBackend
from aserve.model.kv_scales import arm_calculation, calculated_scale
from aserve.model.layers.attention import Attention
from tests.model._paged_batch import PagedBatch
from tests.support.triton_interpreter import requires_interpreter

H, KVH, D = 4, 2, 16
E4M3 = torch.float8_e4m3fn


def _fp8(x: torch.Tensor, scale: float, dtype=E4M3) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def _layers(backend, scales):
    layers = []
    for k_scale, v_scale in scales:
        layer = Attention(H, D, KVH, D**-0.5, backend)
        layer.k_scale, layer.v_scale = k_scale, v_scale
        layers.append(layer)
    return layers


def _written(cache: torch.Tensor, meta, which: int) -> torch.Tensor:
    """The cache rows this step wrote (its slots, in token order) as `[T, KVH, D]` raw fp8."""
    flat = cache[which].reshape(-1, KVH, D)
    return flat[meta.slot_mapping[:meta.num_tokens].long()]


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend], ids=["torch", "triton"])
def test_each_layer_writes_its_own_scales_and_reads_them_back(backend_cls):
    if backend_cls is TritonAttentionBackend:  # CPU tensors: the kernels run interpreted
        requires_interpreter()
    gen = torch.Generator().manual_seed(0)
    scales = [(0.25, 0.5), (4.0, 2.0)]  # different per layer, K and V different
    batch = PagedBatch(len(scales), KVH, D, block_size=8, num_blocks=16, dtype=E4M3)
    backend = backend_cls()
    layers = _layers(backend, scales)
    for layer, cache in zip(layers, batch.kv_caches, strict=True):
        layer.bind_kv_cache(cache)
    _, _, meta = batch.step([(0, list(range(11))), (1, list(range(6)))])  # two prefills
    t = meta.num_tokens
    q = torch.randn(t, H * D, generator=gen)
    raw_k, raw_v = (torch.randn(t, KVH * D, generator=gen) * 20 for _ in range(2))
    for (k_scale, v_scale), layer, cache in zip(scales, layers, batch.kv_caches, strict=True):
        # on the grid of this layer's scales (Triton's interpreter may round fp32 -> fp8 unlike torch)
        k = raw_k if backend_cls is TorchAttentionBackend else _fp8(raw_k, k_scale).float() * k_scale
        v = raw_v if backend_cls is TorchAttentionBackend else _fp8(raw_v, v_scale).float() * v_scale
        out = layer(q, k, v, meta)
        want_k, want_v = _fp8(k.view(t, KVH, D), k_scale), _fp8(v.view(t, KVH, D), v_scale)
        assert torch.equal(_written(cache, meta, 0).view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(_written(cache, meta, 1).view(torch.uint8), want_v.view(torch.uint8))
        # read back: within fp8 rounding (3 mantissa bits: relative error <= 2**-4) of k, v
        back_k = _written(cache, meta, 0).float() * k_scale
        torch.testing.assert_close(back_k, k.view(t, KVH, D), rtol=2**-4, atol=k_scale * 2**-9)
        # the attention read the scaled-back values: same as attending over the dequantized K/V
        ref = TorchAttentionBackend().forward(
            q.view(t, H, D), want_k.float() * k_scale, want_v.float() * v_scale,
            torch.zeros(2, 16, 8, KVH, D), meta, D**-0.5)
        torch.testing.assert_close(out.view(t, H, D), ref, atol=1e-4, rtol=1e-4)
    assert not torch.equal(batch.kv_caches[0].view(torch.uint8), batch.kv_caches[1].view(torch.uint8))


def test_compiled_decode_inputs_carry_each_layers_scales():
    """A decode step as the compiled decode runs it (`DecodeInputs`, one opaque op per layer) writes and
    reads with each layer's own scales: the same result as the planned step."""
    gen = torch.Generator().manual_seed(1)
    scales = [(0.5, 0.125), (2.0, 8.0)]
    planned, compiled = (PagedBatch(2, KVH, D, block_size=8, num_blocks=16, dtype=E4M3) for _ in range(2))
    backend = TorchAttentionBackend()
    layers = _layers(backend, scales)
    prompt = torch.randn(9, KVH * D, generator=gen) * 10
    for batch in (planned, compiled):
        _, _, meta = batch.step([(0, list(range(9)))])
        for layer, cache in zip(layers, batch.kv_caches, strict=True):
            layer.bind_kv_cache(cache)
            layer(torch.randn(9, H * D, generator=gen), prompt, prompt, meta)
    q, k, v = (torch.randn(1, n * D, generator=gen) * 10 for n in (H, KVH, KVH))
    _, _, meta_p = planned.step([(0, [1])])
    _, _, meta_c = compiled.step([(0, [1])])
    for layer, cp, cc in zip(layers, planned.kv_caches, compiled.kv_caches, strict=True):
        layer.bind_kv_cache(cp)
        want = layer(q, k, v, meta_p)
        layer.bind_kv_cache(cc)
        got = layer(q, k, v, decode_inputs(meta_c, cc, backend, None))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert torch.equal(cp.view(torch.uint8), cc.view(torch.uint8))


def test_calculated_scales_come_from_the_first_step_then_stay_fixed():
    gen = torch.Generator().manual_seed(2)
    batch = PagedBatch(2, KVH, D, block_size=8, num_blocks=16, dtype=E4M3)
    layers = _layers(TorchAttentionBackend(), [(1.0, 1.0), (1.0, 1.0)])
    for layer, cache in zip(layers, batch.kv_caches, strict=True):
        layer.bind_kv_cache(cache)
    arm_calculation(torch.nn.ModuleList(layers))
    _, _, meta = batch.step([(0, list(range(7)))])
    first = []
    for i, layer in enumerate(layers):
        k = torch.randn(7, KVH * D, generator=gen) * (100 + 900 * i)  # layer 1's K past 448
        v = torch.randn(7, KVH * D, generator=gen) * (3 + i)
        layer(torch.randn(7, H * D, generator=gen), k, v, meta)
        assert layer.k_scale == pytest.approx(float(k.abs().max()) / 448.0)
        assert layer.v_scale == pytest.approx(float(v.abs().max()) / 448.0)
        assert layer.kv_scales_source == "calculated" and not layer.calculate_kv_scales
        first.append((layer.k_scale, layer.v_scale))
    assert first[0] != first[1]
    _, _, meta = batch.step([(0, [5])])
    for layer, scales in zip(layers, first, strict=True):  # a later, larger step changes nothing
        layer(torch.randn(1, H * D, generator=gen), torch.full((1, KVH * D), 1e4), torch.full((1, KVH * D), 1e4), meta)
        assert (layer.k_scale, layer.v_scale) == scales


def test_calculated_scale_of_each_fp8_dtype():
    x = torch.tensor([[-3.0, 1.0], [0.5, 2.0]])
    assert calculated_scale(x, torch.float8_e4m3fn) == pytest.approx(3.0 / 448.0)
    assert calculated_scale(x, torch.float8_e5m2) == pytest.approx(3.0 / 57344.0)
    assert calculated_scale(torch.zeros(2, 2), torch.float8_e4m3fn) == 1.0
    assert calculated_scale(x, torch.bfloat16) == 1.0  # not an fp8 cache: no scaling
