"""Checkpoints written by llm-compressor's own `oneshot` (SmoothQuant + GPTQ W8A8, FP8_DYNAMIC) on a tiny
Llama (hidden size 128), served with no flags: aserve's greedy tokens equal transformers' greedy generate on
the compressed checkpoint (transformers + compressed-tensors). W8A8: against transformers with its
activation fake-quantization on vLLM's grid (`amax / 127`, what aserve serves), and, with aserve switched
to compressed-tensors' grid (`amax / 127.5`), against transformers' unmodified run. FP8: against
transformers with its activation fake-quantization switched off, since aserve serves FP8 weight-only on CPU
(aserve/model/quantization/fp8.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from aserve.model.quantization import w8a8
from aserve.model.quantization.assign import linear_layers
from tests.model._tiny_models import load_ours
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

pytest.importorskip("llmcompressor")

PROMPT = [5, 17, 33, 9, 100, 200, 7, 8]
NEW_TOKENS = 16


def _compress(root: Path, recipe) -> Path:
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.server.real_tiny_server import build_tiny_chat_model

    src, out = root / "src", root / "out"
    build_tiny_chat_model(root / "tok")  # for its tokenizer (llm-compressor wants a processor)
    save_tiny_hf(src, "llama", seed=0, **{**GREEDY_STABLE, "hidden_size": 128, "intermediate_size": 256,
                                          "tie_word_embeddings": False})
    for f in (root / "tok").glob("tok*"):
        shutil.copy(f, src / f.name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = torch.randint(3, 400, (8, 64), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    oneshot(model=model, processor=tokenizer, dataset=data, recipe=recipe, num_calibration_samples=8,
            max_seq_length=64)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return out


def _vllm_int8_tokens(module, args):
    """A forward pre-hook: vLLM's dynamic per-token int8 rounding of the input (`amax / 127`)."""
    (x,) = args
    a = x.abs().amax(-1, keepdim=True) / 127.0
    a = torch.where(a > 0, a, torch.ones_like(a))
    return (torch.round(x / a).clamp(-128, 127) * a,)


def _transformers_greedy(path: Path, activations: str) -> list[int]:
    """transformers' greedy tokens on the compressed checkpoint; `activations`: "compressed-tensors" (its
    own fake quantization), "vllm" (replaced by vLLM's per-token int8 rounding) or "none"."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if activations != "compressed-tensors":
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None:
                scheme.input_activations = None
                if activations == "vllm":
                    module.register_forward_pre_hook(_vllm_int8_tokens)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(PROMPT):].tolist()


def _aserve_greedy(path: Path) -> list[int]:
    from aserve import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=32, enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    return list(out[0].outputs[0].token_ids)


def test_smoothquant_gptq_w8a8_checkpoint_greedy_equals_transformers(tmp_path):
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    out = _compress(tmp_path, [SmoothQuantModifier(smoothing_strength=0.8),
                               GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"])])
    served = load_ours(out)
    assert {layer.quant_method.name for _, layer in linear_layers(served)} == {"w8a8_int8"}
    # aserve rounds activations as vLLM does (amax / 127): transformers with that rounding
    assert _aserve_greedy(out) == _transformers_greedy(out, activations="vllm")
    # with compressed-tensors' own grid (amax / 127.5) aserve equals transformers' unmodified run: the
    # divisor is the only difference
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(w8a8, "ACT_QMAX", 127.5)
        assert _aserve_greedy(out) == _transformers_greedy(out, activations="compressed-tensors")


def test_fp8_dynamic_checkpoint_greedy_equals_transformers_weight_only(tmp_path):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    out = _compress(tmp_path, [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])])
    served = load_ours(out)
    assert {layer.quant_method.name for _, layer in linear_layers(served)} == {"fp8"}
    assert _aserve_greedy(out) == _transformers_greedy(out, activations="none")
