"""aserve's model with LoRA adapters in slots equals Hugging Face + PEFT (fp32) token for token, for
batches mixing several adapters and base-model tokens in one forward."""

from __future__ import annotations

import pytest
import torch

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

ATOL = 2e-4


def _assert_matches(references, toks, logits):
    for ref, tokens, got in zip(references, toks, logits, strict=True):
        torch.testing.assert_close(got, reference_logits(ref, tokens), atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_lora")
    hf = save_tiny_hf(root / "base", "llama", seed=1)
    peft = {
        1: save_adapter(hf, root / "a1", seed=11, r=8, lora_alpha=16),
        # mixed ranks inside the fused qkv layer and a per-module alpha
        2: save_adapter(hf, root / "a2", seed=12, r=16, lora_alpha=8, rank_pattern={"q_proj": 4, "down_proj": 2},
                        alpha_pattern={"o_proj": 32}),
        # only some modules: the other shards / layers stay zero for this slot
        3: save_adapter(hf, root / "a3", seed=13, r=8, lora_alpha=8, target_modules=["k_proj", "up_proj"]),
        4: save_adapter(hf, root / "a4", seed=14, r=16, lora_alpha=4, use_rslora=True),
    }
    return root, hf, peft


def _setup(root, **config):
    ours = load_ours(root / "base")
    manager = LoRAModelManager(ours, lora_config(**config), "cpu")
    requests = {i: request(i, root / f"a{i}") for i in (1, 2, 3, 4)}
    return ours, manager, requests


def test_mixed_adapters_prefill_and_decode(llama):
    root, hf, peft = llama
    ours, manager, requests = _setup(root)
    toks = prompts([9, 14, 6, 11, 7], seed=1)
    adapter_ids = [1, 2, 0, 1, 3]
    steps = [[(0, 6), (1, 14), (2, 3), (3, 11)],  # chunked prefills: adapters 1, 2, base, 1
             [(0, 1), (2, 1), (4, 7)],  # decodes mixed with a new prompt (adapter 3)
             [(0, 1), (2, 1)],
             [(0, 1), (2, 1)]]
    logits = run_lora_schedule(ours, manager, toks, adapter_ids, steps, requests)
    references = [peft[i] if i else hf for i in adapter_ids]
    _assert_matches(references, toks, logits)
    # the adapter really changes the result (else the test could not fail)
    assert (logits[0] - reference_logits(hf, toks[0])).abs().max() > 1e-2


def test_rslora_scaling(llama):
    root, hf, peft = llama
    ours, manager, requests = _setup(root)
    toks = prompts([10, 5], seed=2)
    logits = run_lora_schedule(ours, manager, toks, [4, 0], [[(0, 10), (1, 5)]], requests)
    _assert_matches([peft[4], hf], toks, logits)


def test_no_mapping_is_exactly_the_base_model(llama):
    root, _, _ = llama
    ours, manager, requests = _setup(root)
    plain = load_ours(root / "base")
    toks = prompts([7, 4], seed=3)
    steps = [[(0, 7), (1, 4)]]
    manager.add_adapter(requests[1])
    got = run_lora_schedule(ours, manager, toks, [0, 0], steps, requests)
    want = run_lora_schedule(plain, manager, toks, [0, 0], steps, requests)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_qwen2_biases_and_lora_bias(tmp_path):
    hf = save_tiny_hf(tmp_path / "base", "qwen2", seed=2)
    peft = save_adapter(hf, tmp_path / "a1", seed=21, r=8, lora_alpha=16, lora_bias=True)
    plain = save_adapter(hf, tmp_path / "a2", seed=22, r=8, lora_alpha=16)
    ours = load_ours(tmp_path / "base")
    manager = LoRAModelManager(ours, lora_config(max_loras=2, enable_lora_bias=True), "cpu")
    requests = {1: request(1, tmp_path / "a1"), 2: request(2, tmp_path / "a2")}
    toks = prompts([8, 6, 5], seed=4)
    logits = run_lora_schedule(ours, manager, toks, [1, 0, 2], [[(0, 8), (1, 6), (2, 5)]], requests)
    _assert_matches([peft, hf, plain], toks, logits)
