"""Test helper: bitsandbytes checkpoints quantized and saved by transformers + bitsandbytes on the CPU (as
`save_pretrained` writes them), and the float copy whose weights are bnb's own dequantization of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def float_copy(src: Path, out: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`src`'s float checkpoint with the weights `weights` (by checkpoint name) swapped in, saved to `out`."""
    state = load_file(str(src / "model.safetensors"))
    state.update({name: w.float().contiguous() for name, w in weights.items()})
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in json.loads((src / "config.json").read_text()).items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(config))
    return out


def dequantized_weights(hf_model) -> dict[str, torch.Tensor]:
    """Each bnb Linear's weight as bnb dequantizes it (4-bit: `dequantize_4bit`; 8-bit: `CB * SCB / 127`)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    out = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            out[f"{name}.weight"] = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        elif isinstance(module, bnb.nn.Linear8bitLt):
            w = module.weight
            scb = w.SCB if getattr(w, "SCB", None) is not None else module.state.SCB
            out[f"{name}.weight"] = w.data.float() * (scb.float() / 127.0).unsqueeze(1)
    assert out, "transformers quantized no Linear"
    return out


def build_bnb(src: Path, root: Path, **bnb_config) -> tuple[Path, Path, torch.nn.Module]:
    """(`root/quant`: `src` quantized by transformers' `BitsAndBytesConfig(**bnb_config)` on the CPU and saved,
    `root/deq`: its dequantized float copy, the in-memory quantized transformers model)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = root / "quant"
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=BitsAndBytesConfig(**bnb_config),
                                                 device_map="cpu", dtype=torch.float32)
    model.save_pretrained(str(quant))
    for extra in src.glob("generation_config.json"):
        shutil.copy(extra, quant / extra.name)
    deq = float_copy(src, root / "deq", dequantized_weights(model))
    return quant, deq, model.eval()
