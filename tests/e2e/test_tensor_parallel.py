"""Tensor parallelism end to end (`--tensor-parallel-size 2` over the `mp` executor: two worker
processes meeting in a gloo group on this CPU): greedy tokens identical to one rank and to Hugging Face
transformers (fp32, tiny random weights) through `LLM.generate`, under chunked prefill and preemption,
for Llama (tied embeddings), Qwen2 (q/k/v biases, untied head), Gemma 2 with a single KV head (replicated
on both ranks; soft-capped scores and logits, sliding windows), Qwen2-MoE (experts split, a shared
expert, a dense layer) and GPT-2 with an odd vocabulary. Then the failure paths: a rank killed mid-stream fails the engine at once, and
a start-up error on the ranks fails the start-up with that error; neither hangs."""

from __future__ import annotations

import json
import shutil

import pytest

from aserve.config import EngineArgs
from aserve.executor.base import ExecutorDeadError
from aserve.executor.process import ProcessExecutor
from tests.e2e.test_hf_equivalence import PROMPTS
from tests.support.multi_rank import check_killed_rank_fails_the_engine, check_matches_one_rank, family_model

FAMILIES = {
    "gemma2-one-kv-head": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 20,
                                      "num_key_value_heads": 1}),
    "qwen2-moe": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    # Conv1D checkpoints (fused q|k|v), biases everywhere, and an odd vocabulary (the last rank's share padded)
    "gpt2-odd-vocab": ("gpt2", {"vocab_size": 501}),
}


@pytest.fixture(scope="module", params=["llama", "qwen2", *FAMILIES])
def model(request, tmp_path_factory):
    """(folder, HF's greedy tokens, one rank's greedy tokens)."""
    if request.param in ("llama", "qwen2"):
        return family_model(request.getfixturevalue(f"tiny_{request.param}"))
    name, overrides = FAMILIES[request.param]
    return family_model(str(tmp_path_factory.mktemp(request.param)), name, **overrides)


@pytest.mark.timeout(180)
def test_two_ranks_match_one_rank_and_hf(model, stat_totals):
    check_matches_one_rank(model, stat_totals, tensor_parallel_size=2)


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_stream_fails_the_engine(tiny_llama):
    check_killed_rank_fails_the_engine(tiny_llama, PROMPTS[0], victim=1, tensor_parallel_size=2)


@pytest.mark.timeout(120)
def test_a_start_up_error_on_the_ranks_fails_the_start_up(tiny_llama, tmp_path):
    """Three layers in config.json, two in the checkpoint: every rank fails loading; the error comes back."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    args = EngineArgs(model=str(folder), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
                      cpu_kvcache_space=0.01, tensor_parallel_size=2)
    executor = ProcessExecutor(args.create_config())
    with pytest.raises(ExecutorDeadError, match=r"(?s)model worker \(rank \d\).*checkpoint is missing"):
        executor.start()
    executor.shutdown()
