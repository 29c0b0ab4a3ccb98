"""EngineArgs.create_config(): defaults that depend on the model or device, and the checks that need them."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs


def test_defaults_follow_vllm(model_dir, monkeypatch):
    monkeypatch.setenv("ASERVE_CPU_BF16", "0")
    cfg = EngineArgs(model=model_dir).create_config()
    assert cfg.cache.block_size == 16 and cfg.scheduler.max_num_seqs == 256
    assert cfg.model.max_model_len == cfg.scheduler.max_model_len == 512 and cfg.model.max_logprobs == 20
    assert cfg.scheduler.policy == "fcfs" and cfg.scheduler.preemption_mode == "recompute"
    assert cfg.scheduler.enable_chunked_prefill and cfg.scheduler.max_num_batched_tokens == 512  # CPU budget
    assert cfg.model.dtype == "float32"  # fp32 checkpoint on a CPU without native bf16
    assert cfg.runner.attention_backend == "torch" and cfg.device.device == "cpu" and cfg.runner.enforce_eager
    assert cfg.parallel.distributed_executor_backend == "uni"
    assert cfg.model.served_model_names == (model_dir,) and cfg.model.tokenizer == model_dir
    monkeypatch.setenv("ASERVE_CPU_BF16", "1")
    assert EngineArgs(model=model_dir).create_config().model.dtype == "bfloat16"


def test_cuda_defaults(model_dir):
    cfg = EngineArgs(model=model_dir).create_config(cuda_available=True)
    assert cfg.device.device == "cuda" and cfg.runner.attention_backend == "triton"
    assert cfg.model.dtype == "float16" and cfg.scheduler.max_num_batched_tokens == 2048
    assert not cfg.runner.enforce_eager


def test_model_path_tokenizer_and_served_names(model_dir):
    cfg = EngineArgs(model="", served_model_name=None).create_config(model_path=model_dir, tokenizer_path="/tok")
    # the bundled model answers to its short name and its Hub id, the one given first
    assert cfg.model.served_model_names == ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert cfg.model.model_path == model_dir and cfg.model.tokenizer == "/tok"
    cfg = EngineArgs(model="HuggingFaceTB/SmolLM2-135M-Instruct").create_config(model_path=model_dir)
    assert cfg.model.served_model_names == ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct")
    cfg = EngineArgs(model=model_dir, served_model_name=["a", "b"]).create_config()
    assert cfg.model.served_model_names == ("a", "b") and cfg.model.served_model_name == "a"


def test_chunked_prefill_off_needs_a_budget_for_the_models_context(model_dir):
    """The model's context (512) is only known from config.json, so validate() cannot catch this."""
    args = EngineArgs(model=model_dir, enable_chunked_prefill=False, max_num_batched_tokens=300, max_num_seqs=8)
    args.validate()
    with pytest.raises(ConfigError, match="^--max-num-batched-tokens: .*max_model_len \\(512\\)"):
        args.create_config()
    cfg = EngineArgs(model=model_dir, enable_chunked_prefill=False).create_config()
    assert cfg.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize("overrides, kwargs, flag", [
    ({}, dict(max_model_len=513), "--max-model-len"),
    ({"architectures": ["FalconForCausalLM"]}, dict(model_impl="aserve"), "--model"),  # auto: Transformers backend
    ({}, dict(device="cuda"), "--device"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 64,
      "layer_types": ["sliding_attention"]}, {}, "--model"),
])
def test_checks_that_need_the_model_or_device(write_model_dir, overrides, kwargs, flag):
    path = write_model_dir(**overrides)
    EngineArgs(model=path, **kwargs).validate()
    with pytest.raises(ConfigError, match=f"^{flag}:"):
        EngineArgs(model=path, **kwargs).create_config(cuda_available=False)


def test_rope_scaling_extends_the_context(model_dir):
    cfg = EngineArgs(model=model_dir, rope_scaling={"rope_type": "linear", "factor": 2.0}).create_config()
    assert cfg.model.max_model_len == 1024 and cfg.model.arch.rope_scaling["factor"] == 2.0
    assert EngineArgs(model=model_dir, rope_theta=5e5).create_config().model.arch.rope_theta == 5e5


def test_disable_sliding_window_caps_the_context_at_the_window(write_model_dir):
    path = write_model_dir(architectures=["MistralForCausalLM"], sliding_window=128)
    assert EngineArgs(model=path).create_config().model.arch.layer_sliding_windows == (128,) * 2
    cfg = EngineArgs(model=path, disable_sliding_window=True).create_config()
    assert cfg.model.arch.layer_sliding_windows == () and cfg.model.max_model_len == 128
    with pytest.raises(ConfigError, match="^--max-model-len: .*--disable-sliding-window"):
        EngineArgs(model=path, disable_sliding_window=True, max_model_len=256).create_config()
    mixed = write_model_dir(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
                            max_window_layers=1)
    cfg = EngineArgs(model=mixed, disable_sliding_window=True).create_config()
    assert cfg.model.arch.layer_sliding_windows == () and cfg.model.max_model_len == 64
