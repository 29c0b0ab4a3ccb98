"""LoRAModelManager: slot residency per step (swaps, LRU slot eviction), the host cache (LRU eviction,
reload from the path), the static slot buffer of CUDA graphs, and refusals."""

from __future__ import annotations

import pytest
import torch

from aserve.model.lora.adapter import LoRAAdapterError
from aserve.model.lora.manager import LoRAModelManager
from tests.model._tiny_models import load_ours
from tests.model.lora._lora_models import (
    lora_config,
    prompts,
    reference_logits,
    request,
    run_lora_schedule,
    save_adapter,
)
from tests.support.tiny_models import save_tiny_hf


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_manager")
    hf = save_tiny_hf(root / "base", "llama", seed=7)
    peft = {i: save_adapter(hf, root / f"a{i}", seed=30 + i, r=8, lora_alpha=16) for i in (1, 2, 3)}
    return root, hf, peft


def _requests(root):
    return {i: request(i, root / f"a{i}") for i in (1, 2, 3)}


def test_one_slot_swaps_between_adapters(setup):
    root, hf, peft = setup
    model = load_ours(root / "base")
    manager = LoRAModelManager(model, lora_config(max_loras=1, max_cpu_loras=2), "cpu")
    requests = _requests(root)
    toks = prompts([6, 6], seed=5)
    for ids in ([1, 0], [2, 0], [1, 1], [0, 2]):  # the slot's occupant changes between steps
        logits = run_lora_schedule(model, manager, toks, ids, [[(0, 6), (1, 6)]], requests)
        for lora_id, tokens, got in zip(ids, toks, logits, strict=True):
            ref = peft[lora_id] if lora_id else hf
            torch.testing.assert_close(got, reference_logits(ref, tokens), atol=2e-4, rtol=1e-4)
        assert manager.slot_of(max(ids)) == 0
    with pytest.raises(ValueError, match="max_loras is 1"):
        manager.prepare_step([1, 2], requests)


def test_slot_eviction_is_lru_and_copies_only_on_change(setup, monkeypatch):
    root, _, _ = setup
    manager = LoRAModelManager(load_ours(root / "base"), lora_config(max_loras=2, max_cpu_loras=3), "cpu")
    requests = _requests(root)
    loads = []
    original = manager._load
    monkeypatch.setattr(manager, "_load", lambda slot, i, a: (loads.append((slot, i)), original(slot, i, a)))
    mapping = manager.prepare_step([1, 1, 0, 2], requests)
    assert mapping.token_slots.tolist() == [0, 0, -1, 1] and loads == [(0, 1), (1, 2)]
    assert manager.prepare_step([2, 1], requests) is not None and len(loads) == 2  # resident: no copy
    manager.prepare_step([1], requests)  # slot 1 (adapter 2) is now the least recently used
    manager.prepare_step([3, 0], requests)
    assert loads[-1] == (1, 3) and manager.slot_of(2) is None and manager.slot_of(1) == 0
    assert manager.prepare_step([0, 0], requests) is None


def test_host_cache_lru_eviction_and_reload(setup):
    root, _, _ = setup
    manager = LoRAModelManager(load_ours(root / "base"), lora_config(max_loras=1, max_cpu_loras=2), "cpu")
    requests = _requests(root)
    manager.add_adapter(requests[1])
    manager.add_adapter(requests[2])
    manager.add_adapter(requests[1])  # 1 is now the most recently used
    manager.add_adapter(requests[3])  # evicts 2
    assert manager.list_adapters() == [1, 3] and not manager.has_adapter(2)
    manager.prepare_step([2], requests)  # reloaded from its path into the cache and a slot
    assert manager.has_adapter(2) and manager.slot_of(2) == 0
    assert manager.list_adapters() == [2, 3]  # 1 was the least recently used idle adapter
    assert manager.remove_adapter(2) and not manager.has_adapter(2) and manager.slot_of(2) is None
    assert not manager.remove_adapter(2)
    with pytest.raises(LoRAAdapterError, match="no request"):
        manager.prepare_step([2], {})
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        manager.add_adapter(request(9, root / "missing"))
    assert manager.list_adapters() == [3]


def test_static_token_slots_buffer(setup):
    root, _, _ = setup
    manager = LoRAModelManager(load_ours(root / "base"), lora_config(max_loras=2), "cpu")
    buffer = manager.static_token_slots(8)
    assert buffer.dtype == torch.int32 and buffer.tolist() == [-1] * 8
    static = manager.static_mapping(6)
    assert static.token_slots.data_ptr() == buffer.data_ptr() and static.num_tokens == 6
    manager.fill_static_token_slots(manager.prepare_step([1, 0, 2], _requests(root)))
    assert buffer.tolist() == [0, -1, 1, -1, -1, -1, -1, -1]
    manager.fill_static_token_slots(None)
    assert buffer.tolist() == [-1] * 8


def test_lora_over_int8_model_adds_to_the_quantized_base(setup):
    """The quantized model: base tokens unchanged, adapter tokens differ (the delta is exact per layer:
    tests/model/lora/test_lora_layers.py)."""
    root, _, _ = setup
    quantized = load_ours(root / "base", quantization="int8")
    plain = load_ours(root / "base", quantization="int8")
    manager = LoRAModelManager(quantized, lora_config(), "cpu")
    other = LoRAModelManager(plain, lora_config(), "cpu")
    toks = prompts([5, 5], seed=6)
    got = run_lora_schedule(quantized, manager, toks, [1, 0], [[(0, 5), (1, 5)]], _requests(root))
    want = run_lora_schedule(plain, other, toks, [0, 0], [[(0, 5), (1, 5)]], _requests(root))
    assert torch.equal(got[1], want[1])
    assert (got[0] - want[0]).abs().max() > 1e-2
    assert "int8+lora" in repr(quantized)


def test_config_limits_are_checked(setup):
    root, _, _ = setup
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAModelManager(load_ours(root / "base"), lora_config(max_loras=3, max_cpu_loras=2), "cpu")
