"""Weight loading: formats, sharded checkpoints, dummy weights, and clear errors for bad checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve.config import KV_CACHE_DTYPE_CHOICES, RESOLVED_DTYPES
from aserve.model.attention.torch_backend import TorchAttentionBackend
from aserve.model.loader import (
    WeightsNotFoundError,
    kv_cache_dtype_for,
    load_model,
    torch_dtype,
    weight_files,
)
from tests.model._tiny_models import engine_config, load_ours
from tests.support.tiny_models import save_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = save_tiny_hf(path, "llama", tie_word_embeddings=False)
    return path, hf


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_weights(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_fused_weights_hold_the_checkpoint_shards(tiny):
    path, hf = tiny
    ours = load_ours(path)
    layer, hf_layer = ours.model.layers[1], hf.model.layers[1]
    q, k, v = layer.self_attn.qkv_proj.split(layer.self_attn.qkv_proj.weight.T)
    assert torch.equal(q.T, hf_layer.self_attn.q_proj.weight)
    assert torch.equal(k.T, hf_layer.self_attn.k_proj.weight)
    assert torch.equal(v.T, hf_layer.self_attn.v_proj.weight)
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, hf_layer.mlp.gate_proj.weight) and torch.equal(up, hf_layer.mlp.up_proj.weight)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight


def test_pytorch_bin_checkpoint(tiny, tmp_path):
    path, hf = tiny
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    torch.save({"step": 3}, tmp_path / "training_args.bin")  # not weights: ignored
    assert weight_files(str(tmp_path), "auto") == ("pt", [str(tmp_path / "pytorch_model.bin")])
    _assert_same_weights(load_ours(tmp_path, load_format="pt"), load_ours(path))
    with pytest.raises(WeightsNotFoundError, match="safetensors"):
        load_ours(tmp_path, load_format="safetensors")


def test_gguf_load_format_reads_the_converted_safetensors(tiny):
    path, _ = tiny
    assert weight_files(str(path), "gguf") == ("safetensors", [str(path / "model.safetensors")])


def test_sharded_safetensors_follow_the_index(tiny, tmp_path):
    path, hf = tiny
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    save_file({"garbage": torch.zeros(1)}, tmp_path / "consolidated.safetensors")  # not in the index
    _assert_same_weights(load_ours(tmp_path), load_ours(path))


def test_dummy_weights_are_seeded_and_need_no_files(tiny, tmp_path):
    path, _ = tiny
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    a = load_ours(tmp_path, load_format="dummy", seed=1)
    b = load_ours(tmp_path, load_format="dummy", seed=1)
    c = load_ours(tmp_path, load_format="dummy", seed=2)
    _assert_same_weights(a, b)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.model.embed_tokens.weight.abs().max() <= 1e-3
    assert (a.model.norm.weight - 1).abs().max() <= 1e-3


def _rewrite_checkpoint(src, dst, edit):
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = load_file(src / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors")


def test_missing_weight_is_named(tiny, tmp_path):
    path, _ = tiny
    _rewrite_checkpoint(path, tmp_path, lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 weight.*layers\.1\.self_attn\.qkv_proj\.weight#1"):
        load_ours(tmp_path)


def test_unknown_tensor_is_named(tiny, tmp_path):
    path, _ = tiny
    _rewrite_checkpoint(path, tmp_path, lambda s: s.update({"model.layers.0.mlp.gate_proj.bias": torch.zeros(96)}))
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.bias"):
        load_ours(tmp_path)


def test_shape_mismatch_is_named(tiny, tmp_path):
    path, _ = tiny
    _rewrite_checkpoint(path, tmp_path, lambda s: s.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\)"):
        load_ours(tmp_path)


def test_tied_checkpoint_may_carry_an_lm_head_copy(tmp_path):
    hf = save_tiny_hf(tmp_path, "llama", tie_word_embeddings=True)
    state = load_file(tmp_path / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, tmp_path / "model.safetensors")
    ours = load_ours(tmp_path)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)


def test_load_model_in_bfloat16(tiny):
    path, hf = tiny
    ours = load_model(engine_config(path, "bfloat16"), TorchAttentionBackend(), "cpu")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert torch.equal(ours.model.norm.weight, hf.model.norm.weight.bfloat16())


def test_kv_cache_dtype_and_torch_dtype(tiny):
    path, _ = tiny
    config = engine_config(path, "bfloat16")
    assert kv_cache_dtype_for(config) == torch.bfloat16
    for name, want in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                       ("fp8_e5m2", torch.float8_e5m2)):
        cfg = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype=name))
        assert kv_cache_dtype_for(cfg) == want
    with pytest.raises(ValueError, match="--dtype"):
        torch_dtype("float64")


def test_the_torch_dtype_tables_cover_every_name_config_resolves_to(tiny):
    """config names dtypes by string; loader.py is the one table to torch dtypes and must know them all."""
    assert [torch_dtype(n) for n in RESOLVED_DTYPES] == [torch.float32, torch.float16, torch.bfloat16]
    config = engine_config(tiny[0], "float32")
    for name in KV_CACHE_DTYPE_CHOICES:
        cfg = dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype=name))
        assert kv_cache_dtype_for(cfg).is_floating_point


@pytest.mark.parametrize(("quantization", "rel_tol"), [("int4", 0.25), ("int8", 0.03)])
def test_load_time_quantization_serves_every_linear_quantized(tiny, quantization, rel_tol):
    from aserve.model.quantization.assign import linear_layers
    from tests.model._tiny_models import run_schedule

    path, _ = tiny
    ref = load_ours(path, "float32")
    model = load_ours(path, "float32", quantization=quantization)
    assert {layer.quant_method.name for _, layer in linear_layers(model)} == {quantization}
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
    tokens = [[3, 17, 99, 5, 42, 7, 8, 250]]
    want = run_schedule(ref, tokens, [[(0, 8)]], block_size=16, num_blocks=8)[0]
    got = run_schedule(model, tokens, [[(0, 8)]], block_size=16, num_blocks=8)[0]
    assert float((got - want).norm() / want.norm()) < rel_tol


def test_dummy_weights_with_int4(tiny):
    from aserve.model.quantization.assign import linear_layers

    path, _ = tiny
    model = load_ours(path, "float32", load_format="dummy", quantization="int4")
    assert all(layer.quant_method.name == "int4" for _, layer in linear_layers(model))


def test_gguf_quantization_needs_a_converted_gguf_folder(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="--quantization gguf: .* not converted from a .gguf file"):
        load_ours(path, "float32", quantization="gguf")


def test_quantization_on_a_non_cpu_device_is_refused(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="CPU only"):
        load_model(engine_config(path, "float32", quantization="int8"), TorchAttentionBackend(), "meta")
