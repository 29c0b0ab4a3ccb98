"""`aserve --data-parallel-size 2` as a server: answers with one replica's greedy outputs under concurrent
requests, /metrics carries vLLM's `engine` label per replica, /health is 200 while every replica lives."""

from __future__ import annotations

import re
from functools import partial

import pytest

from aserve.config import EngineArgs
from aserve.engine.data_parallel import DataParallelEngine
from tests.server.server_harness import concurrent_completion_tokens, running_server

pytestmark = pytest.mark.timeout(300)
PROMPTS = [list(range(40, 80)) + [i] for i in range(3)] + [[5, 6, 7, 8], list(range(300, 333))]


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = EngineArgs(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
                      cpu_kvcache_space=0.02, data_parallel_size=2, distributed_executor_backend="uni")
    with running_server(partial(DataParallelEngine.from_engine_args, args)) as running:
        yield running.engine, running.url


def test_concurrent_completions_equal_one_replica_and_metrics_name_each_replica(server, tiny_llama):
    from aserve import LLM, SamplingParams

    _, url = server
    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=256, cpu_kvcache_space=0.02)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                        use_tqdm=False)]
    got, metrics = concurrent_completion_tokens(url, tiny_llama, PROMPTS, 8)
    assert got == want
    served = {}
    for engine_label in ("0", "1"):
        match = re.search(r'vllm:generation_tokens_total\{[^}]*engine="' + engine_label + r'"[^}]*\} (\S+)', metrics)
        assert match, f"no generation_tokens_total for engine {engine_label}"
        served[engine_label] = float(match.group(1))
    assert served["0"] > 0 and served["1"] > 0 and sum(served.values()) == 8 * len(PROMPTS)
    assert re.search(r'vllm:num_requests_running\{[^}]*engine="1"', metrics)
