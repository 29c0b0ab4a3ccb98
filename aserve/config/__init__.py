"""Engine configuration: vLLM's engine arguments in, one frozen config per concern out.

    EngineArgs (engine_args.py)  --validate()-->  checked without the model's files
               --create_config(model_path)-->  AserveConfig (schema.py), resolved by resolve.py
                                               against config.json (hf_config.py), the dtype
                                               policy (dtype_policy.py) and the CPU (cpu_features.py)

Every error is a `ConfigError` (errors.py) naming the flag or config.json key. The package imports
only the standard library, so every layer (the torch-free server and core included) may use it. The
names below are the public ones; import them from `aserve.config`.
"""

from aserve.config.cpu_features import cpu_bf16_is_fast, cpu_has_native_bf16
from aserve.config.dtype_policy import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, RESOLVED_DTYPES, resolve_dtype
from aserve.config.engine_args import LOAD_FORMATS, EngineArgs
from aserve.config.errors import ConfigError
from aserve.config.hf_config import SUPPORTED_ARCHITECTURES, ArchConfig
from aserve.config.resolve import BUNDLED_MODEL_HUB_ID, BUNDLED_MODEL_NAME
from aserve.config.schema import (
    GiB,
    AserveConfig,
    CacheConfig,
    DeviceConfig,
    KVCacheInfo,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)

__all__ = [
    "BUNDLED_MODEL_HUB_ID", "BUNDLED_MODEL_NAME", "DTYPE_CHOICES", "KV_CACHE_DTYPE_CHOICES", "LOAD_FORMATS", "RESOLVED_DTYPES",
    "SUPPORTED_ARCHITECTURES", "AserveConfig", "ArchConfig", "CacheConfig", "ConfigError", "DeviceConfig",
    "EngineArgs", "GiB", "KVCacheInfo", "LoadConfig", "LoRAConfig", "ModelConfig", "ParallelConfig", "RunnerConfig",
    "SchedulerConfig", "StructuredOutputsConfig", "cpu_bf16_is_fast", "cpu_has_native_bf16", "resolve_dtype",
]
