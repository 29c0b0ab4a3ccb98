"""Tensor parallelism at the config level (aserve/config/parallel.py and its callers): what
--tensor-parallel-size refuses at start-up and why, the executor it picks, each rank's ArchConfig; pipeline parallelism's
combinations not built, refused by name."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.parallel import kv_head_replicas, rank_arch_config

MOE = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80}


def test_tp_defaults_to_one_worker_process_per_rank(model_dir):
    cfg = EngineArgs(model=model_dir, tensor_parallel_size=2).create_config()
    assert cfg.parallel.tensor_parallel_size == 2 and cfg.parallel.distributed_executor_backend == "mp"
    assert cfg.model.arch.num_attention_heads == 4  # the engine keeps the whole model's view
    assert EngineArgs(model=model_dir).create_config().parallel.distributed_executor_backend == "uni"


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(num_attention_heads=6, num_key_value_heads=6), 4, "does not divide the model's 6 attention heads"),
    (dict(num_attention_heads=12, num_key_value_heads=6), 4, "neither divides the model's 6 KV heads"),
    (dict(intermediate_size=130), 4, "does not divide the model's intermediate_size 130"),
    (dict(MOE, moe_intermediate_size=50), 4, "moe_intermediate_size 50"),
    (dict(MOE, shared_expert_intermediate_size=90), 4, "shared_expert_intermediate_size 90"),
])
def test_sizes_that_do_not_split_are_refused_at_start_up(write_model_dir, overrides, tp, message):
    with pytest.raises(ConfigError, match=f"^--tensor-parallel-size: {tp} .*{message}"):
        EngineArgs(model=write_model_dir(**overrides), tensor_parallel_size=tp).create_config()


def test_vocab_sizes_need_not_split(write_model_dir):
    """The embedding and LM head pad the last rank's share, so any vocabulary size is served."""
    EngineArgs(model=write_model_dir(vocab_size=101), tensor_parallel_size=2).create_config()


@pytest.mark.parametrize("kwargs, flag, message", [
    (dict(pipeline_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend",
     "needs 'mp' or 'ray'"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                        "prompt_lookup_max": 3}),
     "--speculative-config", "speculative decoding is not implemented with --pipeline-parallel-size"),
    (dict(pipeline_parallel_size=2, num_scheduler_steps=4), "--num-scheduler-steps", "multi-step decode"),
    (dict(pipeline_parallel_size=2, enable_lora=True), "--enable-lora", "LoRA adapters"),
    (dict(pipeline_parallel_size=2, enable_sleep_mode=True), "--enable-sleep-mode", "sleep mode"),
    (dict(pipeline_parallel_size=2, model_impl="transformers"), "--pipeline-parallel-size", "Transformers backend"),
    (dict(pipeline_parallel_size=2, task="embed"), "--pipeline-parallel-size", "pooling models"),
    (dict(pipeline_parallel_size=2, compilation_config={"level": 3, "compile_sizes": [1]}), "--compilation-config",
     "--pipeline-parallel-size > 1"),
    (dict(pipeline_parallel_size=8), "--pipeline-parallel-size", "8 stages need at least 8 layers"),
    (dict(data_parallel_size=2, enable_lora=True), "--data-parallel-size", "LoRA adapters are not supported"),
    (dict(data_parallel_size=2, enable_sleep_mode=True), "--data-parallel-size", "sleep mode is not supported"),
    (dict(data_parallel_size=2, data_parallel_rank=2), "--data-parallel-rank", "must be in \\[0, "),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend",
     "'mp' \\(processes of this machine\\) or 'ray'"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend",
     "needs 'mp'"),
    (dict(tensor_parallel_size=2, model_impl="transformers"), "--tensor-parallel-size", "Transformers backend"),
    (dict(tensor_parallel_size=2, compilation_config={"level": 3, "compile_sizes": [1]}), "--compilation-config",
     "not implemented with --tensor-parallel-size"),
])
def test_what_is_not_built_is_refused_by_name(model_dir, kwargs, flag, message):
    with pytest.raises(ConfigError, match=f"^{flag}: .*{message}"):
        EngineArgs(model=model_dir, device="cpu", **kwargs).create_config()


def test_pipeline_parallel_resolves_to_ranks_stage_by_stage(model_dir):
    cfg = EngineArgs(model=model_dir, tensor_parallel_size=2, pipeline_parallel_size=2).create_config()
    assert cfg.parallel.distributed_executor_backend == "mp" and cfg.parallel.pipeline_parallel_size == 2
    assert cfg.scheduler.max_steps_in_flight == 2  # one step per stage in flight
    assert cfg.runner.enforce_eager
    assert EngineArgs(model=model_dir).create_config().scheduler.max_steps_in_flight == 1


@pytest.mark.parametrize("architecture", ["GPT2LMHeadModel", "OPTForCausalLM"])
def test_architectures_without_stages_are_refused(write_model_dir, architecture):
    with pytest.raises(ConfigError, match=f"^--pipeline-parallel-size: {architecture} is not split"):
        EngineArgs(model=write_model_dir(architectures=[architecture]), pipeline_parallel_size=2).create_config()


def test_each_rank_sees_its_share_of_heads_and_widths(write_model_dir):
    arch = EngineArgs(model=write_model_dir(**MOE)).create_config().model.arch
    half = rank_arch_config(arch, 2)
    assert (half.num_attention_heads, half.num_key_value_heads, half.intermediate_size) == (2, 1, 64)
    assert (half.family.moe_intermediate_size, half.family.shared_expert_intermediate_size) == (24, 40)
    assert (half.hidden_size, half.head_dim, half.vocab_size) == (arch.hidden_size, arch.head_dim, arch.vocab_size)
    assert rank_arch_config(arch, 1) is arch
    # fewer KV heads (2) than ranks (4): one KV head per rank, each held by 2 ranks
    assert rank_arch_config(arch, 4).num_key_value_heads == 1 and kv_head_replicas(2, 4) == 2
    assert kv_head_replicas(2, 2) == 1
