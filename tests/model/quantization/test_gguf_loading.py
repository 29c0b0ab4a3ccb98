"""`--quantization gguf` end to end on a tiny llama: a converted folder whose float weights are the
dequantized Q4_1/Q4_0 weights of a GGUF file (as `aserve.model.gguf_convert` writes them), and the
file itself. Served natively in fp32 it must give the folder's logits up to float rounding."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from aserve import model_source
from aserve.model.quantization.assign import linear_layers
from tests.model._tiny_models import load_ours, run_schedule
from tests.support.tiny_models import save_tiny_hf
from tests.model.quantization._gguf_files import write_gguf

_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row permutation of q/k (what its converter writes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(folder, gguf path): v_proj of layer 1 is Q8_0, so its fused qkv layer must stay float."""
    folder = tmp_path_factory.mktemp("converted")
    save_tiny_hf(folder, "llama", tie_word_embeddings=False)
    config = json.loads((folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = load_file(str(folder / "model.safetensors"))
    tensors = {}
    for name, w in list(state.items()):
        parts = name.split(".")  # model.layers.N.self_attn.q_proj.weight
        if len(parts) != 6 or parts[4] not in _GGUF_NAMES:
            continue
        layer, proj = parts[2], parts[4]
        kind = "Q8_0" if (layer, proj) == ("1", "v_proj") else ("Q4_0" if proj == "o_proj" else "Q4_1")
        stored = w.numpy()
        heads_here = {"q_proj": heads, "k_proj": kv_heads}.get(proj)
        if heads_here:
            stored = _permute(stored, heads_here)
        tensors[f"blk.{layer}.{_GGUF_NAMES[proj]}.weight"] = (stored, kind)
        dq = dequantize(quantize(stored.astype(np.float32), GGMLQuantizationType[kind]), GGMLQuantizationType[kind])
        if heads_here:
            dq = _unpermute(dq, heads_here)
        state[name] = torch.from_numpy(np.ascontiguousarray(dq, dtype=np.float32))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = write_gguf(tmp_path_factory.mktemp("src") / "tiny.Q4_1.gguf", "llama", tensors, heads, kv_heads)
    (folder / "aserve_source.json").write_text(json.dumps(model_source._source_record(str(path))))
    return folder, path


def test_native_fp32_matches_the_dequantized_folder(converted):
    folder, _ = converted
    ref = load_ours(folder, "float32")
    model = load_ours(folder, "float32", quantization="gguf")
    methods = {name: layer.quant_method.name for name, layer in linear_layers(model)}
    assert methods.pop("model.layers.1.self_attn.qkv_proj") == "unquantized"  # its v_proj is Q8_0
    assert set(methods.values()) == {"gguf"}
    prompts = [[3, 17, 99, 5, 42, 7, 8, 250, 31, 4, 11], [9, 8, 7, 11]]
    # Prompt chunks (more than 4 rows: weights dequantized on the fly), then a decode step of 2 rows
    # (the int4 kernel).
    steps = [[(0, 6), (1, 3)], [(0, 4)], [(0, 1), (1, 1)]]
    for want, got in zip(run_schedule(ref, prompts, steps, 16, 16), run_schedule(model, prompts, steps, 16, 16),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_native_bf16_is_close(converted):
    folder, _ = converted
    ref = load_ours(folder, "float32")
    model = load_ours(folder, "bfloat16", quantization="gguf")
    prompts = [[3, 17, 99, 5, 42, 7, 8, 250]]
    want = run_schedule(ref, prompts, [[(0, 8)]], 16, 8)[0]
    got = run_schedule(model, prompts, [[(0, 8)]], 16, 8)[0].float()
    assert float((got - want).norm() / want.norm()) < 0.05


def test_a_stale_source_is_refused(converted, tmp_path):
    folder, path = converted
    record = json.loads((folder / "aserve_source.json").read_text())
    assert model_source.gguf_source_of(str(folder)) == str(path)
    (tmp_path / "aserve_source.json").write_text(json.dumps({**record, "size": record["size"] + 1}))
    assert model_source.gguf_source_of(str(tmp_path)) is None
