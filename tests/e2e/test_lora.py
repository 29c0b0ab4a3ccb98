"""Multi-LoRA through `LLM.generate`: greedy tokens identical to Hugging Face + PEFT (fp32, tiny random
Llama, three adapters of ranks 8 and 16 targeting all seven projections with random non-zero B) for
adapters mixed in one batch with base-model requests, under chunked prefill, prefix caching (the same
prompt under different adapters must not share KV), preemption, slot pressure (`max_loras=1`) and the
`mp` executor; and LoRA over an int4-quantized base."""

from __future__ import annotations

import copy

import pytest
import torch

from aserve import LLM, LoRARequest, SamplingParams
from aserve.lora import LoRAAdapterError
from tests.e2e.test_hf_equivalence import CASES
from tests.model.lora._lora_models import save_adapter
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

MAX_NEW = 10
_SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 47)), list(range(100, 133)), [3, 4] * 12,
           _SHARED + [40, 41], _SHARED + [40, 41], _SHARED + [40, 41], list(range(200, 209))]
# Which adapter each prompt runs with (0: the base model): the three copies of one prompt run under
# adapters 1 and 2 and the base model, so KV shared across adapters would change their tokens.
ADAPTER_OF = [1, 2, 3, 0, 1, 2, 0, 3]
RUNS = {
    "defaults": dict(max_loras=3),
    "chunked_tiny_budget": dict(CASES["chunked_tiny_budget"], max_loras=3),
    "prefix_caching": dict(CASES["prefix_caching"], max_loras=3),
    "preemption": dict(CASES["preemption"], max_loras=3),
    "slot_pressure": dict(max_loras=1, max_cpu_loras=1),  # three adapters through one slot and one cached
    "mp": dict(max_loras=2, distributed_executor_backend="mp"),
}


def _peft_greedy(base, adapter_path: str | None, prompt: list[int]) -> list[int]:
    from peft import PeftModel

    model = base if adapter_path is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_path).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_e2e")
    hf = save_tiny_hf(root / "base", "llama", seed=1234, perturb=True, **GREEDY_STABLE)
    paths = {1: root / "a1", 2: root / "a2", 3: root / "a3"}
    save_adapter(hf, paths[1], seed=11, r=8, lora_alpha=16)
    save_adapter(hf, paths[2], seed=12, r=16, lora_alpha=32)
    save_adapter(hf, paths[3], seed=13, r=8, lora_alpha=8, use_rslora=True)
    requests = {i: LoRARequest(f"adapter{i}", i, str(p)) for i, p in paths.items()}
    reference = [_peft_greedy(hf, str(paths[a]) if a else None, p) for p, a in zip(PROMPTS, ADAPTER_OF)]
    return str(root / "base"), requests, reference


def _llm(path: str, **kwargs) -> LLM:
    base = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, cpu_kvcache_space=0.05,
                enable_lora=True, max_lora_rank=16)
    return LLM(path, **{**base, **kwargs})


def _generate(llm: LLM, requests, adapter_of=ADAPTER_OF, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    loras = [requests[a] if a else None for a in adapter_of]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("run", list(RUNS))
def test_mixed_adapters_match_hf_peft(lora_setup, run, stat_totals):
    path, requests, reference = lora_setup
    llm = _llm(path, **RUNS[run])
    try:
        totals = stat_totals(llm)
        got = _generate(llm, requests)
        assert got == reference
        assert totals.latest.num_used_blocks == 0
        if run == "preemption":
            assert totals.num_preemptions > 0
        if run == "prefix_caching":  # a second pass hits the cache within each adapter and still matches
            hits = totals.prefix_cache_hits
            assert _generate(llm, requests) == reference
            assert totals.prefix_cache_hits - hits >= 16
    finally:
        if run == "mp":
            llm.engine.shutdown()


def test_adapters_change_the_tokens(lora_setup):
    """The test could not pass with adapters ignored: each adapter's tokens differ from the base model's."""
    path, requests, reference = lora_setup
    llm = _llm(path, max_loras=3)
    base = _generate(llm, requests, adapter_of=[0] * len(PROMPTS))
    assert sum(b != r for b, r, a in zip(base, reference, ADAPTER_OF) if a) >= 4


def test_offline_adapter_api(lora_setup, tmp_path):
    path, requests, _ = lora_setup
    llm = _llm(path, max_loras=2)
    assert llm.add_lora(requests[1]) and not llm.add_lora(requests[1])  # the second is a no-op
    assert llm.list_loras() == {1}
    with pytest.raises(LoRAAdapterError, match="already"):
        llm.add_lora(LoRARequest("adapter1", 9, requests[2].lora_path))  # a name denotes one adapter
    with pytest.raises(LoRAAdapterError, match="no such folder"):
        llm.add_lora(LoRARequest("missing", 5, str(tmp_path / "nowhere")))
    assert llm.remove_lora(1) and not llm.remove_lora(1)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=3, temperature=0.0),
                       use_tqdm=False, lora_request=requests[2])
    assert out[0].lora_request == requests[2] and len(out[0].outputs[0].token_ids) == 3


def test_lora_needs_enable_lora(lora_setup):
    path, requests, _ = lora_setup
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, max_model_len=64, cpu_kvcache_space=0.02)
    with pytest.raises(LoRAAdapterError, match="--enable-lora"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False,
                     lora_request=requests[1])


def test_lora_over_int4_base(lora_setup):
    """The delta is added to the quantized layer's output: the adapters steer the int4 model and the
    base-model requests of the same batch get exactly the int4 model's tokens (exactness of base +
    delta per layer is checked in tests/model/lora/test_lora_layers.py)."""
    path, requests, _ = lora_setup
    llm = _llm(path, quantization="int4", max_loras=3)
    lora = _generate(llm, requests)
    base = _generate(llm, requests, adapter_of=[0] * len(PROMPTS))
    adapted = [i for i, a in enumerate(ADAPTER_OF) if a]
    assert sum(lora[i] != base[i] for i in adapted) >= 4
    assert all(lora[i] == base[i] for i, a in enumerate(ADAPTER_OF) if not a)
