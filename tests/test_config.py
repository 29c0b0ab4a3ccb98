"""EngineArgs validation and resolution: errors name the argument; vLLM's dtype=auto."""

from __future__ import annotations

import json

import pytest

from aserve.config import ArchConfig, ConfigError, EngineArgs, _resolve_dtype, cpu_has_native_bf16


@pytest.fixture()
def model_dir(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "torch_dtype": "float32", "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(block_size=12), "--block-size"),
    (dict(dtype="int8"), "--dtype"),
    (dict(load_format="npcache"), "--load-format"),
    (dict(kv_cache_dtype="int4"), "--kv-cache-dtype"),
    (dict(scheduling_policy="lifo"), "--scheduling-policy"),
    (dict(preemption_mode="drop"), "--preemption-mode"),
    (dict(gpu_memory_utilization=1.5), "--gpu-memory-utilization"),
    (dict(max_num_seqs=0), "--max-num-seqs"),
    (dict(max_model_len=100000), "--max-model-len"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "--max-num-batched-tokens"),
    (dict(tensor_parallel_size=2), "--tensor-parallel-size"),
    (dict(cpu_offload_gb=1), "--cpu-offload-gb"),
    (dict(quantization="awq"), "--quantization"),
    (dict(distributed_executor_backend="ray"), "--distributed-executor-backend"),
    (dict(tokenizer_mode="slow"), "--tokenizer-mode"),
])
def test_bad_values_name_the_argument(model_dir, kwargs, arg):
    with pytest.raises(ConfigError, match=arg):
        EngineArgs(model=model_dir, **kwargs).create_config(model_path=model_dir)


def test_unknown_argument():
    with pytest.raises(ConfigError, match="no_such_flag"):
        EngineArgs.from_kwargs(no_such_flag=1)


@pytest.mark.parametrize(("native_bf16", "dtype"), [("0", "float32"), ("1", "bfloat16")])
def test_defaults_follow_vllm(model_dir, monkeypatch, native_bf16, dtype):
    monkeypatch.setenv("ASERVE_CPU_BF16", native_bf16)  # what the CPU probe reports
    cfg = EngineArgs(model=model_dir).create_config(model_path=model_dir)
    assert cfg.cache.block_size == 16 and cfg.scheduler.max_num_seqs == 256
    assert cfg.model.max_model_len == 512 and cfg.model.max_logprobs == 20
    assert cfg.scheduler.policy == "fcfs" and cfg.scheduler.preemption_mode == "recompute"
    assert cfg.model.dtype == dtype  # an fp32 checkpoint on CPU: bf16 only where the CPU has it natively
    assert cfg.runner.attention_backend == "torch" and cfg.device.device == "cpu"
    assert cfg.model.served_model_names == (model_dir,)


def test_dtype_auto(tmp_path, monkeypatch):
    monkeypatch.delenv("ASERVE_CPU_BF16", raising=False)
    amx = tmp_path / "amx"
    amx.write_text("processor : 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags\t\t: fpu sse avx2 fma\n")
    assert cpu_has_native_bf16(str(amx)) and not cpu_has_native_bf16(str(avx2))
    assert _resolve_dtype("auto", "float32", "cpu", cpu_bf16=True) == "bfloat16"
    assert _resolve_dtype("auto", "bfloat16", "cpu", cpu_bf16=True) == "bfloat16"
    assert _resolve_dtype("auto", "float32", "cpu", cpu_bf16=False) == "float32"
    assert _resolve_dtype("auto", "bfloat16", "cpu", cpu_bf16=False) == "float32"
    assert _resolve_dtype("auto", "float32", "cuda") == "float16"
    assert _resolve_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert _resolve_dtype("half", "bfloat16", "cuda") == "float16"
    assert _resolve_dtype("float", "bfloat16", "cpu") == "float32"


def test_rope_parameters_and_legacy_fields():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    new = ArchConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 5e5}})
    old = ArchConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert new.rope_theta == old.rope_theta == 5e5
    assert new.rope_scaling["rope_type"] == old.rope_scaling["rope_type"] == "linear"
    assert ArchConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
                                   ).rope_scaling is None
