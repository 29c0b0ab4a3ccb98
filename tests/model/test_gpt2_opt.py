"""GPT-2 and OPT over the paged KV cache equal Hugging Face transformers (fp32 logits), in every layout
their configs allow (OPT pre-LN and post-LN, a narrower embedding with project_in/out, GPT-2's Conv1D
weights and unprefixed checkpoints); in bf16 on CPU they track fp32; dummy weights build them."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import save_file

from aserve.kernels import cpu_ops
from tests.model._parity import all_position_logits, decode_step_logits, parity
from tests.model._tiny_models import load_ours, random_schedule, run_schedule
from tests.model.test_llama import _assert_matches_hf, _prompts
from tests.support.tiny_models import save_tiny_hf

VARIANTS = {
    "gpt2": ("gpt2", {}),
    "gpt2-untied-inner-4x-inverse-layer-scale": ("gpt2", {"tie_word_embeddings": False, "intermediate_size": None,
                                                          "scale_attn_by_inverse_layer_idx": True}),
    "gpt2-unscaled-relu": ("gpt2", {"scale_attn_weights": False, "activation_function": "relu"}),
    "opt-pre-ln": ("opt", {}),
    "opt-post-ln": ("opt", {"do_layer_norm_before": False}),
    "opt-project-in-out": ("opt", {"word_embed_proj_dim": 32}),
    "opt-350m-layout": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "opt-no-bias-no-affine-gelu": ("opt", {"enable_bias": False, "layer_norm_elementwise_affine": False,
                                           "activation_function": "gelu"}),
}



@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_hf(tmp_path, variant):
    family, overrides = VARIANTS[variant]
    hf = save_tiny_hf(tmp_path, family, seed=3, **overrides)
    ours = load_ours(tmp_path)
    lengths = [37, 6, 50, 21]
    prompts = _prompts(lengths, seed=4)
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, random_schedule(lengths, seed=5), block_size=16))


@pytest.fixture(scope="module", params=["gpt2", "opt-350m-layout"])
def loaded(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return save_tiny_hf(path, family, seed=11, **overrides), load_ours(path)


@pytest.mark.parametrize("seed", range(3))
def test_mixed_lengths_random_schedules(loaded, seed):
    """Prompts of mixed lengths joining at different steps, chunked and decoded, over every block size."""
    hf, ours = loaded
    lengths = [random.Random(seed).randint(1, 60) for _ in range(5)]
    prompts = _prompts(lengths, seed=seed)
    block_size = (8, 16, 32)[seed]
    steps = random_schedule(lengths, seed)
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, steps, block_size, num_blocks=64, seed=seed))


def _rewrite_checkpoint(src, dst, rename, extra: dict[str, torch.Tensor]) -> None:
    """A copy of the folder `src` whose tensors are renamed by `rename` and joined by `extra`."""
    from safetensors.torch import load_file

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = {rename(k): v.contiguous() for k, v in load_file(src / "model.safetensors").items()}
    save_file({**tensors, **extra}, dst / "model.safetensors")


def test_gpt2_unprefixed_checkpoint_with_mask_buffers_and_stored_head(tmp_path):
    """The original GPT-2 checkpoints: `h.0...` without `transformer.`, the causal-mask buffers, and a
    copy of the embedding as `lm_head.weight`."""
    hf = save_tiny_hf(tmp_path / "hf", "gpt2", seed=7)
    causal = torch.tril(torch.ones(256, 256, dtype=torch.bool)).view(1, 1, 256, 256)
    extra = {f"h.{i}.attn.bias": causal.clone() for i in range(2)}
    extra |= {f"h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(2)}
    extra["lm_head.weight"] = hf.transformer.wte.weight.detach().clone()
    _rewrite_checkpoint(tmp_path / "hf", tmp_path / "old", lambda k: k.removeprefix("transformer."), extra)
    ours = load_ours(tmp_path / "old")
    prompts = _prompts([23, 9])
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, [[(0, 23), (1, 9)]], block_size=8))


def test_opt_decoder_prefixed_checkpoint(tmp_path):
    """Checkpoints that name the decoder `decoder.` (no `model.`) load the same."""
    hf = save_tiny_hf(tmp_path / "hf", "opt", seed=7, word_embed_proj_dim=32)
    _rewrite_checkpoint(tmp_path / "hf", tmp_path / "old", lambda k: k.removeprefix("model."), {})
    ours = load_ours(tmp_path / "old")
    prompts = _prompts([23, 9])
    _assert_matches_hf(hf, prompts, run_schedule(ours, prompts, [[(0, 23), (1, 9)]], block_size=8))


def test_gpt2_checkpoint_shapes_are_checked(tmp_path):
    """A Conv1D weight stored in nn.Linear's layout is refused, naming the tensor (not silently transposed)."""
    save_tiny_hf(tmp_path / "hf", "gpt2", seed=7, intermediate_size=96)
    from safetensors.torch import load_file

    (tmp_path / "bad").mkdir()
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "bad" / "config.json")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["transformer.h.0.mlp.c_fc.weight"] = tensors["transformer.h.0.mlp.c_fc.weight"].t().contiguous()
    save_file(tensors, tmp_path / "bad" / "model.safetensors")
    with pytest.raises(ValueError, match="transformer.h.0.mlp.c_fc.weight"):
        load_ours(tmp_path / "bad")


@pytest.mark.parametrize("variant", ["gpt2", "opt-350m-layout", "opt-pre-ln"])
def test_bfloat16_on_cpu_tracks_float32(tmp_path, variant):
    """bf16 with the CPU Linear forms (C kernels with float32 outputs into the LayerNorms where the CPU
    has them): teacher-forced top-1 agreement with fp32, prefill and decode rows alike."""
    family, overrides = VARIANTS[variant]
    save_tiny_hf(tmp_path, family, seed=5, initializer_range=0.15, **overrides)
    fp32, bf16 = load_ours(tmp_path, "float32"), load_ours(tmp_path, "bfloat16")
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    kernels = cpu_ops.load()
    float_out = {name for name, m in bf16.named_modules() if getattr(m, "float_output", False)}
    if kernels is not None and kernels.packed_matmuls:
        assert float_out and all(n.endswith(type(bf16).float_output_modules) for n in float_out)
    sequences = _prompts([40, 25, 33, 12], seed=6)
    ref = all_position_logits(fp32, sequences)
    report = parity(ref, all_position_logits(bf16, sequences), 0)
    assert report.top1_agreement >= 0.9 and report.mean_kl <= 0.01, str(report)
    prompts = [s[:8] for s in sequences]
    report = parity(ref, decode_step_logits(bf16, prompts, sequences), 0)
    assert report.top1_agreement >= 0.9 and report.mean_kl <= 0.01, str(report)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_dummy_weights_build_and_run(tmp_path, family):
    save_tiny_hf(tmp_path, family, **({"do_layer_norm_before": False} if family == "opt" else {}))
    ours = load_ours(tmp_path, load_format="dummy")
    logits = run_schedule(ours, _prompts([10, 3]), [[(0, 10), (1, 3)]], block_size=8)
    assert all(torch.isfinite(x).all() for x in logits)
