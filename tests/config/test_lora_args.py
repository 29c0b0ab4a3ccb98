"""LoRA engine arguments: vLLM's names and defaults, validated without the model, resolved into LoRAConfig."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs, LoRAConfig
from aserve.config.lora import resolve_lora_config
from aserve.server.args import parse_args


def test_lora_flags_parse_and_resolve():
    engine, _ = parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5",
                            "--lora-dtype", "bfloat16", "--enable-lora-bias", "--lora-extra-vocab-size", "0",
                            "--fully-sharded-loras"])
    engine.validate()
    cfg = resolve_lora_config(engine, "float32", "aserve")
    assert cfg == LoRAConfig(enable_lora=True, max_loras=3, max_lora_rank=32, max_cpu_loras=5,
                             lora_dtype="bfloat16", enable_lora_bias=True, lora_extra_vocab_size=0,
                             fully_sharded_loras=True)


def test_lora_defaults_follow_vllm():
    args = EngineArgs(enable_lora=True)
    args.validate()
    cfg = resolve_lora_config(args, "bfloat16", "aserve")
    assert (cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras, cfg.lora_dtype) == (1, 16, 1, "bfloat16")
    assert cfg.lora_extra_vocab_size == 256
    assert resolve_lora_config(EngineArgs(), "float32", "aserve") == LoRAConfig()  # off: nothing wrapped


@pytest.mark.parametrize("kwargs, flag, words", [
    ({"long_lora_scaling_factors": [4.0]}, "--long-lora-scaling-factors", "LongLoRA"),
    ({"qlora_adapter_name_or_path": "x"}, "--qlora-adapter-name-or-path", "bitsandbytes"),
    ({"max_lora_rank": 7}, "--max-lora-rank", "must be one of"),
    ({"max_loras": 0}, "--max-loras", ">= 1"),
    ({"max_loras": 3, "max_cpu_loras": 2}, "--max-cpu-loras", ">= max_loras"),
    ({"lora_dtype": "int8"}, "--lora-dtype", "must be one of"),
    ({"lora_extra_vocab_size": -1}, "--lora-extra-vocab-size", ">= 0"),
    ({"fully_sharded_loras": True, "tensor_parallel_size": 2}, "--fully-sharded-loras", "not implemented"),
])
def test_bad_lora_arguments_are_refused_naming_the_flag(kwargs, flag, words):
    with pytest.raises(ConfigError, match=flag) as err:
        EngineArgs(**kwargs).validate()
    assert words in str(err.value)


def test_lora_needs_native_model_classes():
    with pytest.raises(ConfigError, match="--enable-lora"):
        resolve_lora_config(EngineArgs(enable_lora=True), "float32", "transformers")
