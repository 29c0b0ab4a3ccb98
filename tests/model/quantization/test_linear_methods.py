"""The Linear quantization-method hook: set before loading, shards fill rows, processed once."""

import pytest
import torch

from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.quantization import load_time_method
from aserve.model.quantization.gguf import GGUFInt4Method
from aserve.model.quantization.int4_cpu import dequantize_int4, quantize_int4
from aserve.model.quantization.unquantized import UnquantizedLinearMethod


def _shards(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 64, generator=gen) * 0.1 for n in (32, 16, 16)]


def _load_merged(layer, shards):
    params = dict(layer.named_parameters())
    for i, w in enumerate(shards):
        layer.load_shard(params["weight"], w, i)
    layer.bias.data.copy_(torch.arange(64, dtype=torch.float32) / 64)


def test_default_method_is_the_float_weight():
    layer = Linear(64, 32, bias=False)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert [n for n, _ in layer.named_parameters()] == ["weight"] and "method=unquantized" in repr(layer)


@pytest.mark.parametrize(("name", "rel_tol"), [("int4", 0.08), ("int8", 0.01)])
def test_load_time_methods_quantize_after_loading(name, rel_tol):
    layer = MergedLinear(64, [32, 16, 16], bias=True)
    layer.set_quant_method(load_time_method(name))
    shards = _shards()
    _load_merged(layer, shards)
    x = torch.randn(5, 64)
    want = x @ torch.cat(shards).T + layer.bias
    layer.process_weights_after_loading()
    assert "weight" not in dict(layer.named_parameters())  # the float weight is gone
    got = layer(x)
    assert float((got - want).norm() / want.norm()) < rel_tol
    q, s, z = layer.split(got)
    assert (q.shape[-1], s.shape[-1], z.shape[-1]) == (32, 16, 16)


def test_gguf_method_takes_components_per_shard():
    layer = MergedLinear(64, [32, 16, 16], bias=False)
    layer.set_quant_method(GGUFInt4Method())
    params = dict(layer.named_parameters())
    assert sorted(params) == ["qweight", "scales", "zeros"]
    shards = [quantize_int4(w) for w in _shards(1)]
    for i, parts in enumerate(shards):
        for suffix, part in zip(("qweight", "scales", "zeros"), parts, strict=True):
            layer.load_shard(params[suffix], part, i)
    layer.process_weights_after_loading()
    x = torch.randn(3, 64)
    want = x @ torch.cat([dequantize_int4(*parts) for parts in shards]).T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_unknown_load_time_method_is_refused():
    with pytest.raises(ValueError, match="--quantization"):
        load_time_method("awq")
