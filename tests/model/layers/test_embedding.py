"""LMHead's CPU forms: the 8-bit head (`use_q8_weight`, GGUF's Q8_0 codes) against the float product."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import cpu_ops
from aserve.model.layers.embedding import Q8_HEAD_MAX_ROWS, LMHead


@pytest.fixture(scope="module")
def kernels() -> cpu_ops.CpuKernels:
    built = cpu_ops.load()
    if built is None or not built.q8_products:
        pytest.skip("no C kernels with 8-bit products here")
    return built


def _q8_head(vocab: int = 96, hidden: int = 64) -> tuple[LMHead, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(-128, 128, (vocab, hidden), generator=gen, dtype=torch.int8)
    scales = torch.rand(vocab, hidden // 32, generator=gen) * 0.02
    head = LMHead(vocab, hidden, dtype=torch.bfloat16)
    head.weight.data.copy_((codes.float().reshape(vocab, -1, 32) * scales[..., None]).reshape(vocab, hidden))
    return head, codes, scales


@pytest.mark.parametrize("rows", [1, Q8_HEAD_MAX_ROWS + 3])
def test_q8_head_computes_the_float_heads_logits(kernels, rows):
    head, codes, scales = _q8_head()
    head.use_cpu_kernel(kernels)
    assert head.use_q8_weight(kernels, codes, scales)
    hidden = torch.randn(rows, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 96)
    if kernels.packed_isa != "avx512_bf16" or rows <= Q8_HEAD_MAX_ROWS:  # the codes, unrounded
        weight = (codes.float().reshape(96, -1, 32) * scales[..., None]).reshape(96, 64)
        torch.testing.assert_close(logits, hidden.float() @ weight.T, rtol=1e-3, atol=1e-3)
    if kernels.packed_isa != "avx512_bf16":  # the 8-bit head alone, at any batch
        assert head.vnni_weight is None and torch.equal(logits, kernels.linear_q8(hidden, head.q8_weight))
    elif rows > Q8_HEAD_MAX_ROWS:  # bf16 dot products for batches
        assert torch.equal(logits, kernels.linear_vnni(hidden, head.vnni_weight, None, torch.float32))


def test_q8_head_is_refused_where_it_cannot_run(kernels):
    head, codes, scales = _q8_head(vocab=80)  # 80 rows: not a multiple of 32
    assert not head.use_q8_weight(kernels, codes, scales) and head.q8_weight is None
    head, codes, scales = _q8_head()
    head.shard = object()  # a vocabulary-parallel head holds only its rank's rows
    assert not head.use_q8_weight(kernels, codes, scales) and head.q8_weight is None
