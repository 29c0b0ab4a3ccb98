import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from aserve.model.quantization.gguf_reader import GGUFLinearWeights
from aserve.model.quantization.int4_cpu import dequantize_int4
from tests.model.quantization._gguf_files import write_gguf


def _reference(path, name, heads=None):
    """The gguf package's dequantization, rows un-permuted like transformers does for llama q/k."""
    tensor = next(t for t in GGUFReader(str(path)).tensors if t.name == name)
    w = torch.from_numpy(np.array(dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))))
    if heads is not None:
        half = w.shape[0] // heads // 2
        w = w.reshape(heads, half, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)
    return w.float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_components_dequantize_like_the_gguf_package(tmp_path, arch):
    rng = np.random.default_rng(1)
    path = write_gguf(tmp_path / "m.gguf", arch, {
        "blk.0.attn_q.weight": (rng.standard_normal((64, 96)) + 0.3, "Q4_1"),  # 4 heads of 16
        "blk.0.attn_k.weight": (rng.standard_normal((32, 96)), "Q4_0"),  # 2 kv heads
        "blk.1.ffn_down.weight": (rng.standard_normal((96, 128)) * 0.05, "Q4_1"),
        "blk.1.ffn_up.weight": (rng.standard_normal((128, 96)), "Q8_0"),
        "blk.1.attn_norm.weight": (rng.standard_normal(96), "F32"),
    })
    g = GGUFLinearWeights(str(path))
    assert sorted(g.names()) == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj",
                                 "model.layers.1.mlp.down_proj", "model.layers.1.mlp.up_proj"]
    assert g.quant_type("model.layers.1.mlp.up_proj") == "Q8_0" and g.quant_type("model.layers.9.mlp.up_proj") is None
    assert g.shape("model.layers.1.mlp.down_proj") == (96, 128)
    permuted = arch == "llama"  # llama.cpp permutes llama's q/k rows; qwen2's are stored as is
    cases = [("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj", 4 if permuted else None),
             ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj", 2 if permuted else None),
             ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj", None)]
    for gguf_name, prefix, heads in cases:
        q, scale, zero = g.int4_components(prefix)
        assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == (q.shape[0], q.shape[1] // 32)
        torch.testing.assert_close(dequantize_int4(q, scale, zero), _reference(path, gguf_name, heads),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not a 4-bit type"):
        g.int4_components("model.layers.1.mlp.up_proj")


def test_unsupported_architecture_is_refused_with_the_way_out(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "gpt2", {"blk.0.attn_q.weight": (np.ones((32, 32)), "Q4_1")})
    with pytest.raises(ValueError, match="drop --quantization"):
        GGUFLinearWeights(str(path))


@pytest.mark.parametrize("with_output", [False, True])
def test_head_q8_components_are_the_output_projection_or_the_tied_embedding(tmp_path, with_output):
    rng = np.random.default_rng(2)
    tensors = {"token_embd.weight": (rng.standard_normal((64, 96)), "Q8_0"),
               "blk.0.ffn_up.weight": (rng.standard_normal((128, 96)), "Q4_1")}
    if with_output:  # an untied head: llama.cpp multiplies by output.weight
        tensors["output.weight"] = (rng.standard_normal((64, 96)) * 2, "Q8_0")
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors)
    codes, scales = GGUFLinearWeights(str(path)).head_q8_components()
    assert codes.dtype == torch.int8 and codes.shape == (64, 96) and scales.shape == (64, 3)
    dequantized = (codes.float().reshape(64, 3, 32) * scales[..., None]).reshape(64, 96)
    name = "output.weight" if with_output else "token_embd.weight"
    torch.testing.assert_close(dequantized, _reference(path, name), rtol=0, atol=0)


def test_head_q8_components_are_none_for_other_types(tmp_path):
    rng = np.random.default_rng(3)
    path = write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": (rng.standard_normal((64, 96)), "F32"),
                                                     "blk.0.ffn_up.weight": (rng.standard_normal((128, 96)), "Q4_1")})
    assert GGUFLinearWeights(str(path)).head_q8_components() is None
