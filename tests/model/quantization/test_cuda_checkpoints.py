"""Quantized checkpoints served on a real GPU (`gpu`-marked: skipped without CUDA). Each format's checkpoint
is built in the test (the same packers as the CPU tests) and run through the offline `LLM` on CUDA, where
the methods take their CUDA forms (`cuda_linear.py`: the Triton dequant-GEMM, `torch._int_mm`,
`torch._scaled_mm`), against the same model dequantized to fp32 on CUDA:

  weight-only (GPTQ with act-order and a short last group, AWQ, compressed-tensors W4A16 / W8A16):
      the same greedy tokens in fp32 activations;
  every format in bf16: teacher-forced mean KL <= 0.02 (see `_check`).

Teacher forcing goes through `prompt_logprobs` over the whole 512-token vocabulary."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.model.quantization import cuda_linear
from tests.model.quantization._ct_checkpoints import build_ct
from tests.model.quantization._quantized_checkpoints import build
from tests.model.quantization.test_fp8 import build_fp8

pytestmark = pytest.mark.gpu

_rng = random.Random(11)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 23, 40, 11, 60, 31, 48, 17)]
MAX_NEW = 16  # ~360 teacher-forced positions
VOCAB = 512  # the tiny models' (GREEDY_STABLE)
HALF = "bfloat16"  # the low-precision activations of the KL checks


def _llm(path, dtype: str, **kwargs) -> LLM:
    return LLM(model=str(path), dtype=dtype, device="cuda", skip_tokenizer_init=True, enforce_eager=False,
               kv_cache_memory_bytes=64 * 2**20, max_model_len=256, **kwargs)


def _release(llm: LLM) -> None:
    llm.engine.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def _greedy(path, dtype: str, **kwargs) -> list[list[int]]:
    llm = _llm(path, dtype, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    _release(llm)
    return [list(o.outputs[0].token_ids) for o in outs]


def _teacher_forced_logprobs(path, dtype: str, sequences: list[list[int]], **kwargs) -> torch.Tensor:
    """Log-probabilities `[positions, vocab]` over the whole (tiny) vocabulary at every position after
    each sequence's first, given the true prefix (`prompt_logprobs` of every token)."""
    llm = _llm(path, dtype, max_logprobs=VOCAB, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=VOCAB, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    _release(llm)
    rows = [entry for o in outs for entry in o.prompt_logprobs[1:]]
    table = torch.full((len(rows), VOCAB), float("-inf"))
    for i, entry in enumerate(rows):
        for token, logprob in entry.items():
            table[i, token] = logprob.logprob
    return table


def _check(quant, deq, *, weight_only: bool, **quant_kwargs) -> None:
    """Weight-only formats: the greedy tokens of the dequantized copy, in fp32 activations. Every format
    in bf16: mean KL(fp32 reference || bf16) <= 0.02 over teacher-forced positions, the reference being
    the dequantized copy for weight-only formats and the same checkpoint in fp32 activations where
    activations are quantized too (that rounding is checked against a reference on CPU). A tiny random
    model's logits are nearly flat (plain bf16 keeps ~97% top-1 on it), so, as on CPU, the top-1
    floors are the bundled SmolLM2's and the tiny models take the KL."""
    reference = _greedy(deq, "float32")
    if weight_only:
        assert _greedy(quant, "float32", **quant_kwargs) == reference
    sequences = [p + r for p, r in zip(PROMPTS, reference, strict=True)]
    want = (_teacher_forced_logprobs(deq, "float32", sequences) if weight_only
            else _teacher_forced_logprobs(quant, "float32", sequences, **quant_kwargs))
    got = _teacher_forced_logprobs(quant, HALF, sequences, **quant_kwargs)
    kl = float((want.exp() * (want - got)).sum(-1).mean())
    assert kl <= 0.02, f"mean KL {kl:.4f} > 0.02 over {want.shape[0]} positions"


@pytest.fixture
def forms(monkeypatch):
    """Which CUDA forms the loaded layers took (the kernel each `cuda_linear` entry point chose)."""
    seen: set[str] = set()
    for name in ("checkpoint_int_linear", "w8a8_linear_cuda", "fp8_scaled_linear"):
        real = getattr(cuda_linear, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            seen.add(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(cuda_linear, name, wrapped)
    return seen


@pytest.mark.parametrize("fmt, options", [
    ("gptq", {"group_size": 64, "desc_act": True, "sym": False, "v1": True, "intermediate_size": 96}),
    ("gptq", {"group_size": 32, "desc_act": False, "sym": True, "v1": False}),
    ("awq", {"group_size": 32}),
    ("compressed-tensors", {"group_size": 32}),
], ids=["gptq-act-order", "gptq-sym", "awq", "ct-w4a16"])
def test_4bit_checkpoints_on_cuda_match_their_dequantized_copy(tmp_path, fmt, options, forms):
    quant, deq = build(tmp_path, fmt, **options)
    _check(quant, deq, weight_only=True)
    assert "checkpoint_int_linear" in forms


@pytest.mark.parametrize("scheme, weight_only, form", [
    ("w8a16", True, "checkpoint_int_linear"), ("w8a8", False, "w8a8_linear_cuda"), ("fp8", False, "fp8_scaled_linear"),
])
def test_compressed_tensors_on_cuda(tmp_path, scheme, weight_only, form, forms):
    quant, deq = build_ct(tmp_path, scheme)
    _check(quant, deq, weight_only=weight_only)
    assert form in forms


def test_fp8_checkpoint_and_online_fp8_on_cuda(tmp_path, forms):
    quant, deq = build_fp8(tmp_path, "channel")
    _check(quant, deq, weight_only=False)
    _check(deq, deq, weight_only=False, quantization="fp8")
    assert "fp8_scaled_linear" in forms
