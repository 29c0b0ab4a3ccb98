"""Greedy tokens identical to Hugging Face transformers (fp32), under every scheduling feature.

The same prompts run through `LLM.generate` with chunked prefill, prefix caching, forced
preemption, several block sizes and max_num_seqs 1 vs 32; each must equal HF's greedy output.
"""

from __future__ import annotations

import random

import pytest

from aserve import LLM, SamplingParams
from tests.support.tiny_models import hf_greedy

MAX_NEW = 12
_rng = random.Random(7)
# Different lengths, plus two prompts that share a 40-token prefix (prefix caching must find it).
_shared = [_rng.randrange(3, 500) for _ in range(40)]
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 33, 64, 9, 100)]
PROMPTS += [_shared + [11, 12, 13], _shared + [21, 22, 23, 24, 25, 26, 27]]

CASES = {
    "defaults": {},
    "chunked_tiny_budget": dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8),
    "no_chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
    "prefix_caching": dict(enable_prefix_caching=True, block_size=8),
    "no_prefix_caching": dict(enable_prefix_caching=False),
    "preemption": dict(num_gpu_blocks_override=18, block_size=8, max_num_seqs=8),
    "swap": dict(num_gpu_blocks_override=18, block_size=8, max_num_seqs=8, preemption_mode="swap", swap_space=0.01),
    "priority_policy": dict(scheduling_policy="priority", num_gpu_blocks_override=18, block_size=8),
    "block_8": dict(block_size=8),
    "block_32": dict(block_size=32),
    "max_num_seqs_1": dict(max_num_seqs=1),
    "max_num_seqs_32": dict(max_num_seqs=32),
}


def _llm(path: str, **kwargs) -> LLM:
    base = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, cpu_kvcache_space=0.05)
    base.update(kwargs)
    return LLM(path, **base)


def _generate(llm: LLM, prompts: list[list[int]], ignore_eos: bool = True) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=ignore_eos, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama_reference(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_reference(tiny_qwen2):
    return hf_greedy(tiny_qwen2, PROMPTS, MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_llama_matches_hf(case, tiny_llama, llama_reference, stat_totals):
    llm = _llm(tiny_llama, **CASES[case])
    totals = stat_totals(llm)
    assert _generate(llm, PROMPTS) == llama_reference
    assert totals.latest.num_used_blocks == 0, "every block must be back in the pool after the requests finish"
    if case == "prefix_caching":
        assert totals.prefix_cache_hits >= 40 - 8, "the shared 40-token prefix must be found in the cache"
    if case in ("preemption", "swap"):
        assert totals.num_preemptions > 0, "18 blocks of 8 tokens cannot hold this batch: it must preempt"


@pytest.mark.parametrize("case", ["defaults", "chunked_tiny_budget", "preemption", "block_32"])
def test_tiny_qwen2_matches_hf(case, tiny_qwen2, qwen2_reference):
    llm = _llm(tiny_qwen2, **CASES[case])
    assert _generate(llm, PROMPTS) == qwen2_reference


def test_prefix_cache_reuse_across_calls(tiny_llama, llama_reference, stat_totals):
    """A second generate over the same prompts hits the cache for every full block and still matches."""
    llm = _llm(tiny_llama, enable_prefix_caching=True, block_size=8)
    totals = stat_totals(llm)
    assert _generate(llm, PROMPTS) == llama_reference
    hits_before = totals.prefix_cache_hits
    assert _generate(llm, PROMPTS) == llama_reference
    hits = totals.prefix_cache_hits - hits_before
    assert hits >= sum((len(p) - 1) // 8 * 8 for p in PROMPTS)


def test_process_executor_matches_hf(tiny_llama, llama_reference):
    llm = _llm(tiny_llama, distributed_executor_backend="mp")
    try:
        assert _generate(llm, PROMPTS[:4]) == llama_reference[:4]
    finally:
        llm.engine.shutdown()


# -- the real bundled model ------------------------------------------------------------------------
SMOL_CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
              "List three prime numbers.", "Explain gravity to a child in one sentence."]


@pytest.fixture(scope="module")
def smol_prompts(bundled_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_model_path)
    return [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for c in SMOL_CHATS]


@pytest.fixture(scope="module")
def smol_reference(bundled_model_path, smol_prompts):
    return hf_greedy(bundled_model_path, smol_prompts, 24, ignore_eos=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["defaults", "chunked_tiny_budget", "preemption", "prefix_caching"])
def test_smollm2_matches_hf(case, bundled_model_path, smol_prompts, smol_reference, stat_totals):
    kwargs = dict(CASES[case], max_model_len=128)
    if case == "preemption":  # 11 usable blocks of 8 tokens for 4 requests of ~60 tokens each
        kwargs.update(num_gpu_blocks_override=12, enable_prefix_caching=False, max_model_len=80)
    llm = LLM("", dtype="float32", cpu_kvcache_space=0.1, **kwargs)
    totals = stat_totals(llm)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in smol_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == smol_reference
    if case == "preemption":
        assert totals.num_preemptions > 0
    tok = llm.get_tokenizer()
    for o, ref in zip(outs, smol_reference):
        assert o.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
