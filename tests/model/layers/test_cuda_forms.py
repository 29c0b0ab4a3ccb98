"""The CUDA forms of the layer ops (`forward_cuda`: aserve's Triton kernels) against their native forms,
run here through the Triton interpreter on CPU tensors (fp32, where the interpreter is exact enough to
compare bit for bit up to float rounding). Dispatch picks them for layers built on a CUDA device;
Gemma's norm (scaled before rounding) keeps its native form there."""

from __future__ import annotations

import pytest
import torch

from aserve.model.layers.activation import SiluAndMul
from aserve.model.layers.norm import GemmaRMSNorm, RMSNorm
from aserve.model.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.usefixtures("triton_interpreter")
CLOSE = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_cuda_devices_get_the_triton_forms():
    assert RMSNorm.choose_form("cuda") == "cuda"
    assert SiluAndMul.choose_form("cuda") == "cuda"
    assert RotaryEmbedding.choose_form("cuda") == "cuda"
    assert GemmaRMSNorm.choose_form("cuda") == "native"


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rms_norm_cuda_form_matches_native(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = 1 + 0.3 * torch.randn(96, generator=gen)
    x, residual = (torch.randn(num_tokens, 96, generator=gen) for _ in range(2))
    torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x), **CLOSE)
    got, got_sum = norm.forward_cuda(x, residual)
    want, want_sum = norm.forward_native(x, residual)
    torch.testing.assert_close(got, want, **CLOSE)
    torch.testing.assert_close(got_sum, want_sum, **CLOSE)


def test_silu_and_mul_cuda_form_matches_native():
    x = torch.randn(5, 2 * 80, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(SiluAndMul().forward_cuda(x), SiluAndMul().forward_native(x), **CLOSE)


@pytest.mark.parametrize("rotary_dim, is_neox", [(32, True), (16, True), (32, False)])
def test_rotary_cuda_form_matches_native(rotary_dim, is_neox):
    gen = torch.Generator().manual_seed(rotary_dim)
    rope = RotaryEmbedding(32, rotary_dim, 128, 10000.0, is_neox=is_neox)
    positions = torch.tensor([0, 5, 17, 99, 127])
    qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=gen)  # q and k as views of a fused projection
    q = qkv[:, :128].view(5, 4, 32)
    k = qkv[:, 128:192].view(5, 2, 32)
    cos_sin = rope.cos_sin(positions)
    got_q, got_k = rope.forward_cuda(cos_sin, q, k)
    want_q, want_k = rope.forward_native(cos_sin, q, k)
    torch.testing.assert_close(got_q, want_q, **CLOSE)
    torch.testing.assert_close(got_k, want_k, **CLOSE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_served_model_runs_the_triton_layer_kernels_on_cuda(tiny_llama, monkeypatch):
    """On CUDA, a generate's profile shows the three layer kernels (eager and graph-captured decode)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from torch.profiler import ProfilerActivity, profile

    from aserve import LLM, SamplingParams

    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
              gpu_memory_utilization=0.3)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=4), use_tqdm=False)
        names = " ".join(e.key for e in prof.key_averages())
        for kernel in ("_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"):
            assert kernel in names, f"{kernel} did not run: {names[:2000]}"
    finally:
        llm.llm_engine.shutdown()
