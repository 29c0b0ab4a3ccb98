import torch

from aserve.model.quantization.int8 import quantize_int8


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
