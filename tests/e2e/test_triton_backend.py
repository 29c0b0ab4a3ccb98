"""The Triton attention backend end to end: same greedy tokens as the torch backend and as HF.

On CPU the kernels run through Triton's interpreter (slow), so the batch is small: four prompts,
a 16-token step budget (chunked prefill, and steps that mix decodes with prefill chunks), and two
prompts sharing a 24-token prefix that the second one must find in the prefix cache.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from aserve import SamplingParams
from aserve.model.attention.triton_backend import TritonAttentionBackend
from tests.support.tiny_models import hf_greedy

MAX_NEW = 4
_rng = random.Random(11)
_shared = [_rng.randrange(3, 500) for _ in range(24)]
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (5, 21)]
PROMPTS += [_shared + [11, 12], _shared + [21, 22, 23]]


def _generate(llm_with_runner, stat_totals, path: str, backend: str, block_size: int):
    """Greedy tokens per prompt, the LLM's stat totals, its runner, and each step's schedule
    (request id -> new tokens)."""
    llm, runner = llm_with_runner(
        path, dtype="float32", skip_tokenizer_init=True, attention_backend=backend, block_size=block_size,
        max_model_len=64, cpu_kvcache_space=0.01, max_num_seqs=4, max_num_batched_tokens=16,
        enable_chunked_prefill=True, enable_prefix_caching=True)
    totals = stat_totals(llm)
    steps: list[dict[str, int]] = []
    execute = runner.execute

    def recording_execute(so):
        steps.append(dict(zip(so.scheduled_req_ids, so.num_scheduled_tokens)))
        return execute(so)

    runner.execute = recording_execute
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], totals, runner, steps


@pytest.mark.parametrize(("model", "block_size"), [("tiny_llama", 8), ("tiny_qwen2", 16)])
def test_triton_matches_torch_backend_and_hf(model, block_size, request, llm_with_runner, stat_totals):
    path = request.getfixturevalue(model)
    reference = hf_greedy(path, PROMPTS, MAX_NEW, ignore_eos=True)

    got, totals, runner, steps = _generate(llm_with_runner, stat_totals, path, "triton", block_size)
    assert all(sum(step.values()) <= 16 for step in steps)
    assert any(1 in step.values() and max(step.values()) > 1 for step in steps), "a step must mix decode and prefill"
    prefill_steps = Counter(req_id for step in steps for req_id, n in step.items() if n > 1)
    assert max(prefill_steps.values()) > 1, "some prompt's prefill must be split over several steps"
    assert all(isinstance(layer.self_attn.attn.backend, TritonAttentionBackend)
               for layer in runner.model.model.layers)
    assert totals.prefix_cache_hits >= block_size, "the shared 24-token prefix must come from the cache"
    assert totals.latest.num_used_blocks == 0

    want, _, _, _ = _generate(llm_with_runner, stat_totals, path, "torch", block_size)
    assert want == reference
    assert got == reference
