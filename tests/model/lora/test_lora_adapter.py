"""load_peft_adapter: PEFT names onto the model's (fused) Linear layers, scaling folded in, and every
refused adapter named with LoRAAdapterError."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve.model.lora.adapter import LoRAAdapterError, load_peft_adapter
from tests.model._tiny_models import load_ours
from tests.model.lora._lora_models import lora_config, save_adapter
from tests.support.tiny_models import save_tiny_hf


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_adapter")
    hf = save_tiny_hf(root / "base", "llama", seed=5)
    save_adapter(hf, root / "good", seed=1, r=8, lora_alpha=16)
    save_adapter(hf, root / "bias", seed=2, r=8, lora_alpha=16, lora_bias=True)
    return root, load_ours(root / "base")


def _variant(setup, tmp_path, edit_config=None, edit_tensors=None, extra_file=None, source="good"):
    root, _ = setup
    path = tmp_path / "variant"
    shutil.copytree(root / source, path)
    if edit_config:
        config = json.loads((path / "adapter_config.json").read_text())
        edit_config(config)
        (path / "adapter_config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = load_file(str(path / "adapter_model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(path / "adapter_model.safetensors"))
    if extra_file:
        (path / extra_file).write_text("{}")
    return path


def test_maps_packed_modules_and_folds_scaling(setup):
    root, model = setup
    adapter = load_peft_adapter(root / "good", model, lora_config())
    tensors = load_file(str(root / "good" / "adapter_model.safetensors"))
    qkv = adapter.modules["model.layers.1.self_attn.qkv_proj"]
    assert len(qkv) == 3 and all(w is not None for w in qkv)
    k = qkv[1]
    prefix = "base_model.model.model.layers.1.self_attn.k_proj"
    assert torch.equal(k.lora_a, tensors[f"{prefix}.lora_A.weight"])
    torch.testing.assert_close(k.lora_b, tensors[f"{prefix}.lora_B.weight"] * 2.0)  # alpha 16 / r 8
    assert len(adapter.modules["model.layers.0.mlp.gate_up_proj"]) == 2
    assert adapter.rank == 8 and adapter.num_bytes > 0
    bf16 = load_peft_adapter(root / "good", model, lora_config(lora_dtype="bfloat16"))
    assert bf16.modules["model.layers.0.mlp.down_proj"][0].lora_b.dtype == torch.bfloat16


def test_bin_weights_are_read(setup, tmp_path):
    _, model = setup
    path = _variant(setup, tmp_path)
    torch.save(load_file(str(path / "adapter_model.safetensors")), str(path / "adapter_model.bin"))
    (path / "adapter_model.safetensors").unlink()
    assert load_peft_adapter(path, model, lora_config()).rank == 8


def _drop_a(tensors):
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]


def _bad_shape(tensors):
    name = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    tensors[name] = tensors[name][:, :10].contiguous()


def _embedding_tensor(tensors):
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 500)


def _unknown_module(tensors):
    tensors["base_model.model.model.layers.0.mlp.fc9.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.layers.0.mlp.fc9.lora_B.weight"] = torch.zeros(64, 8)


def _dora_tensor(tensors):
    tensors["base_model.model.model.layers.0.mlp.down_proj.lora_magnitude_vector"] = torch.ones(64)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"edit_config": lambda c: c.update(use_dora=True)}, "DoRA"),
    ({"edit_tensors": _dora_tensor}, "DoRA"),
    ({"edit_config": lambda c: c.update(modules_to_save=["lm_head"])}, "modules_to_save"),
    ({"edit_config": lambda c: c.update(target_modules=["q_proj", "embed_tokens"])}, "embed_tokens"),
    ({"edit_config": lambda c: c.update(target_modules=["lm_head"])}, "lm_head"),
    ({"edit_tensors": _embedding_tensor}, "embeddings"),
    ({"extra_file": "added_tokens.json"}, "adds tokens"),
    ({"extra_file": "new_embeddings.safetensors"}, "extra vocabulary"),
    ({"edit_tensors": _drop_a}, "lora_A missing"),
    ({"edit_tensors": _bad_shape}, "do not fit"),
    ({"edit_tensors": _unknown_module}, "does not have"),
    ({"edit_config": lambda c: c.update(r=4)}, "adapter_config.json says 4"),
    ({"source": "bias"}, "enable-lora-bias"),
    ({"edit_config": lambda c: c.update(peft_type="IA3")}, "not LoRA"),
], ids=["dora", "dora-tensor", "modules_to_save", "embed_tokens", "lm_head", "embedding-tensor", "added_tokens",
        "new_embeddings", "missing-A", "shape", "unknown-module", "rank-mismatch", "bias-disabled", "not-lora"])
def test_refused_adapters(setup, tmp_path, kwargs, match):
    _, model = setup
    path = _variant(setup, tmp_path, **kwargs)
    with pytest.raises(LoRAAdapterError, match=match):
        load_peft_adapter(path, model, lora_config())


def test_rank_above_max_and_missing_files(setup, tmp_path):
    root, model = setup
    with pytest.raises(LoRAAdapterError, match="above --max-lora-rank 4"):
        load_peft_adapter(root / "good", model, lora_config(max_lora_rank=4))
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        load_peft_adapter(tmp_path / "nope", model, lora_config())
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        load_peft_adapter(tmp_path / "empty", model, lora_config())
    path = _variant(setup, tmp_path)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="no adapter_model"):
        load_peft_adapter(path, model, lora_config())
    assert issubclass(LoRAAdapterError, ValueError)


def test_bias_accepted_when_enabled(setup):
    root, model = setup
    adapter = load_peft_adapter(root / "bias", model, lora_config(enable_lora_bias=True))
    assert adapter.modules["model.layers.0.self_attn.o_proj"][0].lora_bias is not None
