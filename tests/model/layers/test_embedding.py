"""LMHead's CPU forms: the 8-bit head (`use_q8_weight`, GGUF's Q8_0 codes) against the float product, and the
greedy screen (`LMHead.greedy`, greedy_head.py) against the argmax of the full logits."""

from __future__ import annotations

import pytest
import torch

from aserve.kernels import cpu_ops
from aserve.model.layers.embedding import Q8_HEAD_MAX_ROWS, LMHead
from aserve.model.layers.greedy_head import MAX_ROWS as GREEDY_MAX_ROWS


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


def _bf16_head(vocab: int = 256, hidden: int = 64, seed: int = 8) -> LMHead:
    """Random rows, a run of rows a few 8-bit steps from one another (32-63) and two exactly equal rows (10 and
    the last)."""
    gen = torch.Generator().manual_seed(seed)
    head = LMHead(vocab, hidden, dtype=torch.bfloat16)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    weight[32:64] = weight[32] + torch.randn(32, hidden, generator=gen) * 0.002
    weight[-1] = weight[10]
    head.weight.data.copy_(weight)
    return head


@pytest.mark.parametrize("rows", [1, GREEDY_MAX_ROWS])
def test_greedy_head_is_the_full_heads_argmax(kernels, rows):
    if not kernels.packed_matmuls:
        pytest.skip("no packed bf16 products here")
    head = _bf16_head()
    head.use_cpu_kernel(kernels)
    assert head.greedy_screen is not None
    for trial in range(30):
        hidden = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(trial)) * 3).bfloat16()
        if trial == 0:  # rows 10 and the last tie for the largest logit: the first wins
            hidden = (head.weight.data[10].float() * 40).bfloat16().expand(rows, 64).contiguous()
        elif trial == 1:  # the near rows lead
            hidden = (head.weight.data[32].float() * 40).bfloat16().expand(rows, 64).contiguous()
        want = head(hidden).argmax(dim=-1).tolist()
        assert head.greedy(hidden) == want
        if trial == 0:
            assert want == [10] * rows


def test_greedy_head_declines_what_it_cannot_screen(kernels):
    if not kernels.packed_matmuls:
        pytest.skip("no packed bf16 products here")
    head = _bf16_head()
    head.use_cpu_kernel(kernels)
    hidden = torch.randn(2, 64).bfloat16()
    assert head.greedy(hidden.float()) is None  # float32 rows keep the float product
    assert head.greedy(torch.randn(GREEDY_MAX_ROWS + 1, 64).bfloat16()) is None  # more rows: the logits
    hidden[1, 5] = float("inf")
    assert head.greedy(hidden) is None  # a non-finite row: the caller computes the logits
    odd = _bf16_head(vocab=80)  # not a multiple of 32
    odd.use_cpu_kernel(kernels)
    assert odd.greedy_screen is None and odd.greedy(hidden[:1]) is None
    gguf, codes, scales = _q8_head(vocab=96)
    gguf.use_cpu_kernel(kernels)
    assert gguf.use_q8_weight(kernels, codes, scales) and gguf.greedy_screen is None  # the 8-bit weight is the head
    assert gguf.greedy(torch.randn(1, 64).bfloat16()) is None
