"""Pipeline parallelism end to end (`--pipeline-parallel-size 2` over the `mp` executor: one worker
process per stage, the residual stream sent between them over gloo, two steps in flight): greedy tokens
identical to one rank and to Hugging Face transformers (fp32, tiny random weights) through
`LLM.generate`, under chunked prefill and preemption, for Llama, Qwen2 (biases), Qwen2-MoE (a dense
layer among MoE ones) and Gemma 2 (a scaled embedding, sliding windows), in bf16 too; tensor x pipeline parallel
(2 x 2 = 4 ranks, stages of uneven depth); the async engine serving concurrent requests with both steps
in flight; and a later stage's rank killed mid-stream failing the engine at once."""

from __future__ import annotations

import anyio
import pytest

from aserve.config import EngineArgs
from aserve.engine.async_engine import AsyncEngine
from tests.e2e.test_hf_equivalence import PROMPTS, _generate, _llm
from tests.support.multi_rank import (
    CHUNKED_AND_PREEMPTED,
    MAX_NEW,
    check_killed_rank_fails_the_engine,
    check_matches_one_rank,
    family_model,
    stream_concurrently,
)
from tests.support.tiny_models import GREEDY_STABLE, hf_greedy, save_tiny_hf

FAMILIES = {
    "llama": ("llama", {"num_hidden_layers": 3}),  # stages of 2 and 1 layers
    "qwen2": ("qwen2", {}),
    "qwen2-moe": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 20}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    """(folder, HF's greedy tokens, one rank's greedy tokens)."""
    name, overrides = FAMILIES[request.param]
    return family_model(str(tmp_path_factory.mktemp(request.param)), name, **overrides)


@pytest.mark.timeout(180)
def test_two_stages_match_one_rank_and_hf(model, stat_totals):
    check_matches_one_rank(model, stat_totals, pipeline_parallel_size=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("forms", ["cpu kernels", "native"])
def test_bf16_stages_match_one_rank(tiny_llama, forms, monkeypatch):
    """In a bf16 model the CPU kernels keep the residual stream float32 and the native forms (as on
    CUDA) round it to bf16: each stage hands the next the stream in the dtype it had."""
    if forms == "native":
        monkeypatch.setenv("ASERVE_FORCE_NATIVE_OPS", "1")
    one_rank = _generate(_llm(tiny_llama, dtype="bfloat16", **CHUNKED_AND_PREEMPTED), PROMPTS)
    llm = _llm(tiny_llama, dtype="bfloat16", pipeline_parallel_size=2, **CHUNKED_AND_PREEMPTED)
    try:
        assert _generate(llm, PROMPTS) == one_rank
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(240)
def test_tensor_times_pipeline_parallel_matches_one_rank(tmp_path):
    save_tiny_hf(tmp_path, "llama", seed=1234, perturb=True, **{**GREEDY_STABLE, "num_hidden_layers": 3})
    reference = hf_greedy(str(tmp_path), PROMPTS, MAX_NEW, ignore_eos=True)
    llm = _llm(str(tmp_path), tensor_parallel_size=2, pipeline_parallel_size=2, **CHUNKED_AND_PREEMPTED)
    try:
        assert len(llm.engine.core._executor.pids) == 4
        assert _generate(llm, PROMPTS) == reference
    finally:
        llm.engine.shutdown()


@pytest.mark.timeout(120)
def test_the_async_engine_serves_concurrent_requests_with_two_steps_in_flight(tiny_llama):
    reference = hf_greedy(tiny_llama, PROMPTS, MAX_NEW, ignore_eos=True)

    async def main():
        args = EngineArgs(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                          cpu_kvcache_space=0.02, pipeline_parallel_size=2, max_num_seqs=2)
        engine = AsyncEngine.from_engine_args(args)
        submitted: list = []
        submit = engine.engine.core.submit

        def counting_submit(so):
            submitted.append(len(engine.engine.core.scheduler._in_flight))
            submit(so)

        engine.engine.core.submit = counting_submit
        assert await stream_concurrently(engine, PROMPTS, MAX_NEW) == reference
        assert max(submitted) > 0  # a step was submitted while another one's requests were in flight

    anyio.run(main)


@pytest.mark.timeout(120)
def test_a_later_stage_killed_mid_stream_fails_the_engine(tiny_llama):
    check_killed_rank_fails_the_engine(tiny_llama, PROMPTS[0], victim=1, pipeline_parallel_size=2)
