"""oneDNN-packed bf16 Linear weights and LM head on CPU (`aserve/model/quantization/cpu_packed.py`, the
form where aserve's C kernel has no native bf16 dot product): bit-identical to `F.linear`; the loader's
CPU forms go to float layers only and are switched off by ASERVE_FORCE_NATIVE_OPS."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aserve.model.layers.custom_op import FORCE_NATIVE_ENV
from aserve.model.layers.embedding import LMHead
from aserve.model.layers.linear import Linear, MergedLinear
from aserve.model.quantization.assign import linear_layers, use_cpu_linear_forms
from aserve.model.quantization.cpu_packed import CpuPackedLinearMethod, cpu_packing_supported
from aserve.model.quantization.int8 import Int8WeightOnlyMethod

pytestmark = pytest.mark.skipif(not cpu_packing_supported(torch.bfloat16, "cpu"),
                                reason="oneDNN has no bf16 kernels for this CPU")


class _TinyModel(torch.nn.Module):
    dtype = torch.bfloat16

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.qkv = MergedLinear(64, [64, 32, 32], bias=True, dtype=torch.bfloat16)
        self.down = Linear(128, 64, dtype=torch.bfloat16)
        self.int8 = Linear(64, 64, dtype=torch.bfloat16)
        self.int8.set_quant_method(Int8WeightOnlyMethod())
        self.lm_head = LMHead(96, 64, dtype=torch.bfloat16)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen).to(p.dtype)


def test_packed_layers_give_f_linears_exact_results_for_any_row_count():
    model = _TinyModel()
    weights = {n: (m.weight.detach().clone(), m.bias) for n, m in (("qkv", model.qkv), ("down", model.down))}
    head_weight = model.lm_head.weight.detach().clone()
    model.lm_head.pack_for_cpu()
    for layer in (model.qkv, model.down):
        layer.quant_method = CpuPackedLinearMethod()
        layer.process_weights_after_loading()
        assert not hasattr(layer, "weight") or layer.weight is None  # the float copy is dropped
    for rows in (1, 5, 16):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        w, b = weights["qkv"]
        assert torch.equal(model.qkv(x), F.linear(x, w, b))
        assert torch.equal(model.lm_head(x), F.linear(x, head_weight).float())
        x2 = torch.randn(rows, 128).to(torch.bfloat16)
        assert torch.equal(model.down(x2), F.linear(x2, weights["down"][0]))


def test_cpu_forms_go_to_float_layers_only():
    model = _TinyModel()
    assert use_cpu_linear_forms(model) == 2  # the two float Linears; the int8 layer keeps its method
    assert isinstance(model.int8.quant_method, Int8WeightOnlyMethod)
    methods = {type(layer.quant_method) for name, layer in linear_layers(model) if name != "int8"}
    assert len(methods) == 1 and methods != {type(model.int8.quant_method)}
    assert (model.lm_head.packed_weight is not None) != (model.lm_head.cpu_kernels is not None)


def test_force_native_and_fp32_keep_f_linear(monkeypatch):
    assert not cpu_packing_supported(torch.float32, "cpu")
    monkeypatch.setenv(FORCE_NATIVE_ENV, "1")
    model = _TinyModel()
    assert use_cpu_linear_forms(model) == 0
    assert model.lm_head.packed_weight is None and model.lm_head.cpu_kernels is None
