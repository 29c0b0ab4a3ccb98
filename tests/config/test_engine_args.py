"""EngineArgs.validate(): every check that needs no model files, each error naming the flag."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs

NO_SUCH_MODEL = "/nonexistent/model-folder"


@pytest.mark.parametrize("kwargs, flag", [
    (dict(block_size=12), "--block-size"),
    (dict(dtype="int8"), "--dtype"),
    (dict(load_format="zip"), "--load-format"),
    (dict(kv_cache_dtype="int4"), "--kv-cache-dtype"),
    (dict(scheduling_policy="lifo"), "--scheduling-policy"),
    (dict(preemption_mode="drop"), "--preemption-mode"),
    (dict(device="tpu"), "--device"),
    (dict(attention_backend="flash"), "--attention-backend"),
    (dict(generation_config="/nonexistent/folder"), "--generation-config"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
    (dict(gpu_memory_utilization=float("nan")), "--gpu-memory-utilization"),
    (dict(swap_space=float("inf")), "--swap-space"),
    (dict(swap_space=-1), "--swap-space"),
    (dict(max_num_seqs=0), "--max-num-seqs"),
    (dict(max_logprobs=-1), "--max-logprobs"),
    (dict(max_model_len=0), "--max-model-len"),
    (dict(max_num_batched_tokens=0), "--max-num-batched-tokens"),
    (dict(num_gpu_blocks_override=0), "--num-gpu-blocks-override"),
    (dict(cpu_kvcache_space=0.0), "--cpu-kvcache-space"),
    (dict(rope_theta=-1.0), "--rope-theta"),
    (dict(served_model_name=[]), "--served-model-name"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128), "--max-num-batched-tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "--max-num-batched-tokens"),  # < max_num_seqs
    (dict(preemption_mode="swap", swap_space=0), "--swap-space"),
    # accepted vLLM flags that are not implemented: refused, never ignored
    (dict(tensor_parallel_size=0), "--tensor-parallel-size"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend"),
    (dict(tensor_parallel_size=2, quantization="gguf"), "--quantization"),
    (dict(pipeline_parallel_size=2, num_scheduler_steps=2), "--num-scheduler-steps"),
    (dict(data_parallel_size=2, enable_lora=True), "--data-parallel-size"),
    (dict(cpu_offload_gb=-1), "--cpu-offload-gb"),
    (dict(quantization="gptq", load_format="bitsandbytes"), "--load-format"),  # it implies bitsandbytes
    (dict(quantization="gguf"), "--quantization"),  # a hub id / missing path is not a .gguf source
    (dict(quantization="int4", device="cuda"), "--quantization"),  # the int4/int8 kernels are CPU only
    (dict(quantization="gguf", load_format="dummy"), "--quantization"),
    (dict(distributed_executor_backend="fork"), "--distributed-executor-backend"),
])
def test_bad_values_are_refused_before_any_model_work(kwargs, flag):
    """The model folder does not exist: the error is about the flag, so no model file was needed."""
    args = EngineArgs(model=NO_SUCH_MODEL, **kwargs)
    with pytest.raises(ConfigError, match=f"^{flag}:"):
        args.validate()
    with pytest.raises(ConfigError, match=f"^{flag}:"):  # create_config validates before reading the model
        args.create_config()


@pytest.mark.parametrize("kwargs, flag", [
    (dict(max_num_seqs="8"), "--max-num-seqs"),
    (dict(block_size=16.0), "--block-size"),
    (dict(enforce_eager=1), "--enforce-eager"),
    (dict(max_model_len=True), "--max-model-len"),
    (dict(hf_overrides=["rope_theta", 1]), "--hf-overrides"),
    (dict(served_model_name=["a", 2]), "--served-model-name"),
    (dict(model=None), "--model"),
])
def test_wrong_types_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=f"^{flag}: expected"):
        EngineArgs(**kwargs).validate()


def test_good_values_pass():
    EngineArgs().validate()
    EngineArgs(model=NO_SUCH_MODEL, swap_space=2, gpu_memory_utilization=1, served_model_name=["a", "b"],
               enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256, preemption_mode="swap",
               hf_overrides={"rope_theta": 5e5}, block_size=128, dtype="half", kv_cache_dtype="fp8").validate()


def test_unknown_argument():
    with pytest.raises(ConfigError, match="no_such_flag"):
        EngineArgs.from_kwargs(no_such_flag=1)
    assert EngineArgs.from_kwargs(block_size=32).block_size == 32


@pytest.mark.parametrize("kwargs", [
    dict(model="", quantization="gguf"),  # the bundled GGUF
    dict(model="/somewhere/model.Q4_1.gguf", quantization="gguf", load_format="gguf"),
    dict(model=NO_SUCH_MODEL, quantization="int4"),
    dict(model=NO_SUCH_MODEL, quantization="int8", device="cpu"),
])
def test_implemented_quantizations_pass_validation(kwargs):
    EngineArgs(**kwargs).validate()


def test_async_output_processing_is_off_on_cpu_unless_asked_for(model_dir):
    """As vLLM: on CPU the output processing would take cores from the forward pass (README)."""
    def disabled(**kwargs) -> bool:
        return EngineArgs(model=model_dir, device="cpu", **kwargs).create_config().runner.disable_async_output_proc

    assert disabled()
    assert not disabled(disable_async_output_proc=False)
    assert disabled(disable_async_output_proc=True)
