import pytest
import torch

from aserve.model.layers.linear import Linear
from aserve.model.quantization.int4_cpu import FP32_KERNEL_MAX_ROWS
from aserve.model.quantization.int8 import Int8WeightOnlyMethod, quantize_int8


def test_quantize_int8_error_is_at_most_half_a_step():
    w = torch.randn(24, 40)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (q.float() * scale.unsqueeze(1) - w).abs()
    assert bool((err <= scale.unsqueeze(1) / 2 + 1e-7).all())


def test_zero_row_stays_zero():
    w = torch.zeros(16, 32)
    q, scale = quantize_int8(w)
    assert not bool(q.any()) and not bool(scale.any())


@pytest.mark.parametrize("rows", [1, FP32_KERNEL_MAX_ROWS + 2])  # the kernel, then dequantized on the fly
def test_int8_layer_computes_with_the_quantized_weight(rows):
    layer = Linear(40, 24, bias=True)
    layer.set_quant_method(Int8WeightOnlyMethod())
    w = torch.randn(24, 40)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(24))
    layer.process_weights_after_loading()
    q, scale = quantize_int8(w)
    x = torch.randn(rows, 40)
    torch.testing.assert_close(layer(x), x @ (q.float() * scale.unsqueeze(1)).T + layer.bias, rtol=1e-5, atol=1e-5)
