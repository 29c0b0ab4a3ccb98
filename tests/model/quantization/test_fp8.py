"""FP8 checkpoints (`quant_method: fp8`, float8_e4m3fn weights with per-tensor, per-channel or 2-D block
scales, written in-test from a tiny random Llama as vLLM / llm-compressor / DeepSeek write them) served in
fp32 must give the same greedy tokens as their dequantized fp32 copy; online `--quantization fp8` of a
float checkpoint must keep top-1 >= 98% teacher-forced against fp32 and reflect FP8 rounding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve.model.quantization.assign import linear_layers
from tests.model._parity import greedy_generate, teacher_forced_parity
from tests.model._tiny_models import load_ours, run_schedule
from tests.model.quantization._quantized_checkpoints import write_pair
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[3, 17, 99, 5, 42, 7, 8, 250, 31, 4, 11], [9, 8, 7, 11]]
STEPS = [[(0, 6), (1, 3)], [(0, 4)], [(0, 1), (1, 1)]]
NEW_TOKENS = 8
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _quantize(w: torch.Tensor, mode: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 codes, the scale tensor as written on disk, dequantized fp32 weight)."""
    n, k = w.shape
    if mode == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(())
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale, q.float() * scale
    if mode == "channel":
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX  # [N, 1]
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale, q.float() * scale
    bn, bk = block
    rows, cols = torch.arange(n) // bn, torch.arange(k) // bk
    scale = torch.zeros(-(-n // bn), -(-k // bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[rows == i][:, cols == j].abs().amax() / FP8_MAX
    full = scale[rows][:, cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale, q.float() * full


def build_fp8(root: Path, mode: str, *, static: bool = False, block: tuple[int, int] = (32, 32),
              seed: int = 0, **overrides) -> tuple[Path, Path]:
    """Write `(fp8 checkpoint, dequantized fp32 copy)` under `root`; `mode` "tensor" | "channel" | "block"."""
    src, quant, deq = root / "src", root / "fp8", root / "dequantized"
    save_tiny_hf(src, "llama", seed=seed, **{**GREEDY_STABLE, "tie_word_embeddings": False, **overrides})
    state = load_file(str(src / "model.safetensors"))
    qstate, dstate = {}, {}
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) < 3 or parts[-2] not in PROJECTIONS or parts[-1] != "weight":
            qstate[name] = dstate[name] = w
            continue
        prefix = name[: -len(".weight")]
        q, scale, dq = _quantize(w.float(), mode, block)
        qstate[name] = q.contiguous()
        qstate[f"{prefix}.weight_scale_inv" if mode == "block" else f"{prefix}.weight_scale"] = scale.contiguous()
        if static:
            qstate[f"{prefix}.input_scale"] = torch.tensor(0.05)
        dstate[name] = dq.contiguous()
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    if mode == "block":
        qc["weight_block_size"] = list(block)
    write_pair(src, quant, qstate, deq, dstate, qc)
    return quant, deq


def _check_same(quant: Path, deq: Path) -> None:
    ours = load_ours(quant, "float32")
    layers = linear_layers(ours)
    assert {layer.quant_method.name for _, layer in layers} == {"fp8"}
    assert all(layer.fp8_weight.dtype == FP8 for _, layer in layers)  # kept in 1 byte a weight
    ref = load_ours(deq, "float32")
    for got, want in zip(run_schedule(ours, PROMPTS, STEPS, 16), run_schedule(ref, PROMPTS, STEPS, 16), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert greedy_generate(ours, PROMPTS, NEW_TOKENS) == greedy_generate(ref, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("mode,static", [("tensor", False), ("tensor", True), ("channel", False)],
                         ids=["per-tensor-dynamic", "per-tensor-static", "per-channel"])
def test_fp8_checkpoint_same_greedy_tokens_as_dequantized(tmp_path, mode, static):
    quant, deq = build_fp8(tmp_path, mode, static=static)
    _check_same(quant, deq)


def test_fp8_block_scaled_checkpoint_same_greedy_tokens_as_dequantized(tmp_path):
    # blocks of 32 x 32: down_proj's K = 96 has 3 column blocks, q/k/v and gate/up each their own blocks
    quant, deq = build_fp8(tmp_path, "block", block=(32, 32), intermediate_size=96)
    _check_same(quant, deq)


def test_fp8_fused_shards_keep_their_own_per_tensor_scales(tmp_path):
    quant, _ = build_fp8(tmp_path, "tensor")
    ours = load_ours(quant, "float32")
    qkv = dict(linear_layers(ours))["model.layers.0.self_attn.qkv_proj"]
    state = load_file(str(quant / "model.safetensors"))
    scales = [state[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qkv"]
    assert len({float(s) for s in scales}) == 3  # the test means something
    sizes = [state[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0] for p in "qkv"]
    want = torch.cat([s.reshape(1, 1).expand(n, 1) for s, n in zip(scales, sizes, strict=True)])
    torch.testing.assert_close(qkv.fp8_scale, want.float())


def test_fp8_checkpoint_with_wrong_scales_changes_the_output(tmp_path):
    quant, deq = build_fp8(tmp_path, "channel")
    state = load_file(str(quant / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale"
    state[name] = state[name].flip(0).contiguous()
    save_file(state, str(quant / "model.safetensors"), metadata={"format": "pt"})
    ours, ref = load_ours(quant, "float32"), load_ours(deq, "float32")
    got, want = run_schedule(ours, PROMPTS, STEPS, 16), run_schedule(ref, PROMPTS, STEPS, 16)
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(got, want, strict=True))


def test_online_fp8_top1_and_fp8_rounding(tmp_path):
    src = tmp_path / "src"
    save_tiny_hf(src, "llama", seed=3, **{**GREEDY_STABLE, "tie_word_embeddings": False})
    ref = load_ours(src, "float32")
    online = load_ours(src, "float32", quantization="fp8")
    layers = linear_layers(online)
    assert {layer.quant_method.name for _, layer in layers} == {"fp8"}
    assert all(layer.fp8_weight.dtype == FP8 for _, layer in layers)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 512, (48,), generator=gen).tolist() for _ in range(4)]
    # A tiny random model's logits are nearly flat (plain bf16 gets ~97% top-1 here), so top-1 >= 98% is
    # checked on the bundled SmolLM2 (tests/model/test_quantized_bundled.py, case "fp8"); here the KL.
    report = teacher_forced_parity(ref, online, sequences, start=1)
    assert report.mean_kl <= 0.02, str(report)
    # the outputs are those of the per-channel FP8-rounded weights: the same as a per-channel fp8
    # checkpoint's dequantized copy, and not the fp32 model's
    _, deq = build_fp8(tmp_path / "ckpt", "channel", seed=3)
    rounded = load_ours(deq, "float32")
    got = run_schedule(online, PROMPTS, STEPS, 16)
    for a, b in zip(got, run_schedule(rounded, PROMPTS, STEPS, 16), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                   for a, b in zip(got, run_schedule(ref, PROMPTS, STEPS, 16), strict=True))


def test_online_fp8_in_bf16_close_to_fp32(tmp_path):
    src = tmp_path / "src"
    save_tiny_hf(src, "llama", seed=1, **{**GREEDY_STABLE, "tie_word_embeddings": False})
    ref = load_ours(src, "float32")
    online = load_ours(src, "bfloat16", quantization="fp8")
    gen = torch.Generator().manual_seed(1)
    sequences = [torch.randint(3, 512, (32,), generator=gen).tolist() for _ in range(3)]
    report = teacher_forced_parity(ref, online, sequences, start=1)
    assert report.mean_kl <= 0.02, str(report)
