"""CPU -O3: the compiled decode gives the eager engine's greedy tokens, runs for its sizes only (other
batches fall back to eager), and never recompiles as contexts grow past block edges.

The graph is captured whole (fullgraph) with torch.compile's `eager` backend, which checks all of the
above without inductor's code generation (tens of seconds of C++ compiling a run); inductor itself is
exercised by the benchmarks (README: -O3 rows)."""

from __future__ import annotations

import torch

from aserve import LLM, SamplingParams
from aserve.runner.compiled_decode import CompiledDecode

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(30, 52))]


def _greedy(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=128, block_size=16, cpu_kvcache_space=0.02, skip_tokenizer_init=True,
              enable_prefix_caching=False, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
    solo = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    both = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return solo + [o.outputs[0].token_ids for o in both]


def test_compiled_decode_matches_eager_and_never_recompiles_while_serving(tiny_llama, monkeypatch):
    eager = _greedy(tiny_llama)
    calls = []
    real_run = CompiledDecode.run
    monkeypatch.setattr(CompiledDecode, "run", lambda self, *a: calls.append(a[0].shape[0]) or real_run(self, *a))
    frames_before = None

    real_warm_up = CompiledDecode.warm_up

    def warm_up(self):
        nonlocal frames_before
        seconds = real_warm_up(self)
        frames_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        return seconds

    monkeypatch.setattr(CompiledDecode, "warm_up", warm_up)
    compiled = _greedy(tiny_llama, compilation_config={"level": 3, "compile_sizes": [1], "backend": "eager"})
    assert compiled == eager
    # 2 solo requests x 39 decode steps ran compiled; the batch of two ran eagerly
    assert calls and set(calls) == {1} and len(calls) == 2 * 39
    # contexts went from 7 and 22 tokens to 46 and 61 (across block edges) without a new graph
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames_before
