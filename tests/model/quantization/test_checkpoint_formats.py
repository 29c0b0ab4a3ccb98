"""GPTQ and AWQ checkpoints (written in-test with each format's reference quantization and exact packing,
tests/model/quantization/_quantized_checkpoints.py) served natively in fp32 must give the same greedy
tokens as their dequantized fp32 copy, served by aserve and by Hugging Face; a wrongly packed one must not."""

from __future__ import annotations

import pytest
import torch

from aserve.model.quantization.assign import linear_layers
from aserve.model.quantization.checkpoint_formats import AWQ_ORDER, unpack
from tests.model._parity import greedy_generate
from tests.model._tiny_models import load_ours, run_schedule
from tests.model.quantization._quantized_checkpoints import build, pack
from tests.support.tiny_models import hf_greedy

PROMPTS = [[3, 17, 99, 5, 42, 7, 8, 250, 31, 4, 11], [9, 8, 7, 11]]
NEW_TOKENS = 8
# Prompt chunks of more than 4 rows (the kernel's fp32 form multiplies by the weight dequantized on the
# fly) and decode rows (the 4-bit kernel itself).
STEPS = [[(0, 6), (1, 3)], [(0, 4)], [(0, 1), (1, 1)]]


def _methods(model) -> dict[str, str]:
    return {name: layer.quant_method.name for name, layer in linear_layers(model)}


def _kernels(model) -> set[str]:
    return {"int4" if hasattr(layer, "int4_weight") or hasattr(layer, "int4_c_codes") else "dequantized"
            for _, layer in linear_layers(model) if layer.quant_method.name != "unquantized"}


def _check_same(quant, deq, fmt: str, kernels: set[str], hf: bool = False) -> None:
    ours = load_ours(quant, "float32")
    assert set(_methods(ours).values()) == {fmt}  # the LM head is not quantized: it is not a Linear here
    assert _kernels(ours) == kernels
    ref = load_ours(deq, "float32")
    for got, want in zip(run_schedule(ours, PROMPTS, STEPS, 16), run_schedule(ref, PROMPTS, STEPS, 16), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tokens = greedy_generate(ours, PROMPTS, NEW_TOKENS)
    assert tokens == greedy_generate(ref, PROMPTS, NEW_TOKENS)
    if hf:
        assert tokens == hf_greedy(str(deq), PROMPTS, NEW_TOKENS, ignore_eos=True)


def test_unpack_inverts_both_packings():
    codes = torch.randint(0, 16, (8, 16))
    assert torch.equal(unpack(pack(codes, 1), 4, 1), codes.to(torch.uint8))
    assert torch.equal(unpack(pack(codes, 0), 4, 0), codes.to(torch.uint8))
    assert torch.equal(unpack(pack(codes, 1, AWQ_ORDER), 4, 1, AWQ_ORDER), codes.to(torch.uint8))
    assert not torch.equal(unpack(pack(codes, 1, AWQ_ORDER), 4, 1), codes.to(torch.uint8))


@pytest.mark.parametrize("options", [
    dict(group_size=32, desc_act=False, sym=True, v1=True),
    # act-order, asymmetric, v2 zeros; down_proj (K = 96) has a short last group of 32
    dict(group_size=64, desc_act=True, sym=False, v1=False, intermediate_size=96),
    dict(group_size=-1, desc_act=False, sym=False, v1=True, family="qwen2"),
], ids=["g32-sym-v1", "g64-actorder-asym-v2-short", "g-1-asym-v1-qwen2"])
def test_gptq_same_greedy_tokens_as_dequantized(tmp_path, options):
    quant, deq = build(tmp_path, "gptq", **options)
    _check_same(quant, deq, "gptq", {"int4"}, hf=options["group_size"] == 64)


def test_gptq_group_size_the_kernel_cannot_take_serves_dequantized(tmp_path):
    # group size 48: K = 64 has groups 48 + 16 and K = 128 has 48 + 48 + 32 (GPTQ's ceil(K / group) groups)
    quant, deq = build(tmp_path, "gptq", group_size=48, desc_act=True, sym=True, v1=True)
    _check_same(quant, deq, "gptq", {"dequantized"})


def test_awq_same_greedy_tokens_as_dequantized(tmp_path):
    quant, deq = build(tmp_path, "awq", group_size=32, family="qwen2")
    _check_same(quant, deq, "awq", {"int4"}, hf=True)


def test_compressed_tensors_w4a16_same_greedy_tokens_as_dequantized(tmp_path):
    quant, deq = build(tmp_path, "compressed-tensors", group_size=32)
    _check_same(quant, deq, "compressed-tensors", {"int4"})


def test_awq_packed_in_gptq_nibble_order_changes_the_output(tmp_path):
    quant, deq = build(tmp_path, "awq", group_size=32, wrong_order=True)
    ours, ref = load_ours(quant, "float32"), load_ours(deq, "float32")
    got = run_schedule(ours, PROMPTS[:1], [[(0, 11)]], 16)[0]
    want = run_schedule(ref, PROMPTS[:1], [[(0, 11)]], 16)[0]
    assert float((got - want).abs().max()) > 0.1


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_wider_groups_keep_one_scale_per_group_in_bf16(tmp_path, fmt):
    """Group size 64 in bf16: the kernel holds one scale per format group (not repeated per 32 columns:
    fewer resident bytes), and the outputs are those of the dequantized copy to bf16 rounding."""
    from aserve.kernels import cpu_ops

    quant, deq = build(tmp_path, fmt, group_size=64, intermediate_size=128)
    ours = load_ours(quant, "bfloat16")
    for name, layer in linear_layers(ours):
        assert layer.int4_group_size == 64, name
        kernels = cpu_ops.load()
        if kernels is not None and kernels.packed_matmuls:  # the C form: [N/16, K/64, 16] scales
            assert layer.int4_c_scale.shape[1] == layer.input_size // 64, name
    from tests.model._parity import teacher_forced_parity

    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(3, 512, (32,), generator=gen).tolist() for _ in range(3)]
    report = teacher_forced_parity(load_ours(deq, "float32"), ours, sequences, start=1)
    assert report.mean_kl <= 0.02, str(report)
