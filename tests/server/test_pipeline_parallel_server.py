"""`aserve --pipeline-parallel-size 2` as a server: concurrent completions (streamed and whole) get one
rank's greedy tokens while two steps are in flight; /health is 200 and /metrics counts every token."""

from __future__ import annotations

import re
from functools import partial

import pytest

from aserve.config import EngineArgs
from aserve.engine.async_engine import AsyncEngine
from tests.server.server_harness import concurrent_completion_tokens, running_server

pytestmark = pytest.mark.timeout(300)
PROMPTS = [list(range(40, 80)) + [i] for i in range(3)] + [[5, 6, 7, 8], list(range(300, 333))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = EngineArgs(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      cpu_kvcache_space=0.02, pipeline_parallel_size=2, max_num_seqs=2)
    with running_server(partial(AsyncEngine.from_engine_args, args)) as running:
        yield running.engine, running.url


def test_concurrent_completions_equal_one_rank(server, tiny_llama):
    from aserve import LLM, SamplingParams

    engine, url = server
    assert engine.config.scheduler.max_steps_in_flight == 2
    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256, cpu_kvcache_space=0.02)
    want = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)]
    got, metrics = concurrent_completion_tokens(url, tiny_llama, PROMPTS, MAX_TOKENS, stream_every_other=True)
    assert got == want
    match = re.search(r"vllm:generation_tokens_total\{[^}]*\} (\S+)", metrics)
    assert match and float(match.group(1)) == MAX_TOKENS * len(PROMPTS)
