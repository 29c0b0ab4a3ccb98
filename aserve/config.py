"""Typed, frozen configuration: one config per concern, built once from `EngineArgs`.

`EngineArgs` carries vLLM's engine-argument names and defaults; `EngineArgs.create_config()`
validates every value once (errors name the argument) and returns an `AserveConfig`.
Nothing downstream re-validates. What the runner learns at start-up (KV block count)
lives in `KVCacheInfo`, never written back into these configs.

This module imports only the standard library (plus msgspec-free json), so every layer may use it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_LOAD_FORMATS = ("auto", "pt", "safetensors", "dummy", "gguf")
_BLOCK_SIZES = (8, 16, 32, 64, 128)
_PREEMPTION_MODES = (None, "recompute", "swap")
_POLICIES = ("fcfs", "priority")
_DEVICES = ("auto", "cpu", "cuda")
_EXECUTOR_BACKENDS = (None, "uni", "mp")
_ATTENTION_BACKENDS = (None, "torch", "triton")
_TOKENIZER_MODES = ("auto", "slow")
_GENERATION_CONFIG = ("auto", "vllm")
# EngineArgs fields limited to a set of values: (field, allowed, how errors name them; None = the tuple).
_CHOICE_FIELDS: tuple[tuple[str, tuple[Any, ...], str | None], ...] = (
    ("dtype", _DTYPES, None),
    ("kv_cache_dtype", _KV_CACHE_DTYPES, None),
    ("load_format", _LOAD_FORMATS, None),
    ("block_size", _BLOCK_SIZES, None),
    ("preemption_mode", _PREEMPTION_MODES, "'recompute' or 'swap'"),
    ("scheduling_policy", _POLICIES, None),
    ("device", _DEVICES, None),
    ("distributed_executor_backend", _EXECUTOR_BACKENDS, "'uni' or 'mp' (ray is not implemented yet)"),
    ("attention_backend", _ATTENTION_BACKENDS, "'torch' or 'triton'"),
    ("tokenizer_mode", _TOKENIZER_MODES, None),
)

GiB = 1 << 30


class ConfigError(ValueError):
    """A configuration value or combination is invalid; the message names the argument."""


def _require(ok: bool, arg: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"--{arg.replace('_', '-')}: {msg}")


@dataclass(frozen=True)
class ArchConfig:
    """The model's architecture, read from its config.json (plus overrides)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], hf_overrides: dict[str, Any] | None = None) -> ArchConfig:
        cfg = {**cfg, **(hf_overrides or {})}
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 writes rope_parameters; older configs have rope_theta / rope_scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params:
            kind = rope_params.get("rope_type", rope_params.get("type", "default"))
            if kind != "default":
                rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            rope_scaling["rope_type"] = kind
            if kind == "default":
                rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "MistralForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=int(sliding) if sliding else None,
        )


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for (name, folder, .gguf path, or "" for the bundled default)
    model_path: str  # the resolved local Hugging Face folder
    tokenizer: str  # resolved local folder (or hub id) for the tokenizer
    tokenizer_mode: str
    revision: str | None
    tokenizer_revision: str | None
    trust_remote_code: bool
    dtype: str  # resolved: "float32" | "float16" | "bfloat16"
    max_model_len: int
    seed: int
    served_model_names: tuple[str, ...]
    max_logprobs: int
    generation_config: str
    arch: ArchConfig
    skip_tokenizer_init: bool = False

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    swap_space_gb: float = 4.0
    cpu_offload_gb: float = 0.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kvcache_space_gb: float = 4.0  # the KV budget on CPU devices (vLLM: VLLM_CPU_KVCACHE_SPACE)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"
    download_dir: str | None = None


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # resolved: "cpu" | "cuda"


@dataclass(frozen=True)
class ParallelConfig:
    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner executes: graphs, eager fallback, attention backend."""

    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    attention_backend: str = "torch"  # resolved: "torch" | "triton"
    disable_async_output_proc: bool = False


@dataclass(frozen=True)
class ObservabilityConfig:
    disable_log_stats: bool = False


@dataclass(frozen=True)
class AserveConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    load: LoadConfig
    device: DeviceConfig
    parallel: ParallelConfig
    runner: RunnerConfig
    observability: ObservabilityConfig


@dataclass(frozen=True)
class KVCacheInfo:
    """What the runner learns at start-up and the scheduler needs: never written back into configs."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int


@dataclass
class EngineArgs:
    """vLLM's engine arguments, same names and defaults (see the seeds); `create_config` validates."""

    model: str = ""
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    revision: str | None = None
    tokenizer_revision: str | None = None
    trust_remote_code: bool = False
    download_dir: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    swap_space: float = 4.0
    cpu_offload_gb: float = 0.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kvcache_space: float | None = None  # GiB; default from ASERVE_CPU_KVCACHE_SPACE or 4
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    max_logprobs: int = 20
    enforce_eager: bool = False
    max_seq_len_to_capture: int = 8192
    enable_chunked_prefill: bool | None = None
    preemption_mode: str | None = None
    scheduling_policy: str = "fcfs"
    rope_scaling: dict[str, Any] | None = None
    rope_theta: float | None = None
    hf_overrides: dict[str, Any] | None = None
    generation_config: str = "auto"
    served_model_name: str | list[str] | None = None
    disable_log_stats: bool = False
    device: str = "auto"
    distributed_executor_backend: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    disable_async_output_proc: bool = False
    attention_backend: str | None = None
    quantization: str | None = None
    disable_sliding_window: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    # -- validation ---------------------------------------------------------------------------------
    def _validate_choices(self) -> None:
        for name, allowed, described in _CHOICE_FIELDS:
            value = getattr(self, name)
            what = described or f"one of {allowed}"
            _require(value in allowed, name, f"must be {what}, got {value!r}")
        _require(self.generation_config in _GENERATION_CONFIG or os.path.isdir(self.generation_config),
                 "generation_config", "must be 'auto', 'vllm' or a folder holding generation_config.json")

    def _validate_numbers(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _require(self.max_logprobs >= 0, "max_logprobs", f"must be >= 0, got {self.max_logprobs}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _require(self.swap_space >= 0, "swap_space", f"must be >= 0, got {self.swap_space}")
        _require(self.cpu_offload_gb >= 0, "cpu_offload_gb", f"must be >= 0, got {self.cpu_offload_gb}")
        _require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                 "num_gpu_blocks_override", f"must be >= 1, got {self.num_gpu_blocks_override}")
        _require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                 f"must be >= 1, got {self.max_model_len}")
        _require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                 "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_seq_len_to_capture >= 1, "max_seq_len_to_capture", "must be >= 1")
        _require(self.cpu_kvcache_space is None or self.cpu_kvcache_space > 0, "cpu_kvcache_space",
                 f"must be > 0 GiB, got {self.cpu_kvcache_space}")

    def _reject_unimplemented(self) -> None:
        """Accepted-but-unimplemented arguments fail loudly here instead of being ignored."""
        _require(self.tensor_parallel_size == 1, "tensor_parallel_size", "only 1 is implemented")
        _require(self.pipeline_parallel_size == 1, "pipeline_parallel_size", "only 1 is implemented")
        _require(self.quantization is None, "quantization",
                 "quantized weights are not implemented; GGUF files are dequantized at load time")
        _require(self.cpu_offload_gb == 0, "cpu_offload_gb", "weight offloading is not implemented yet")
        _require(self.tokenizer_mode != "slow", "tokenizer_mode", "'slow' tokenizers are not implemented; use 'auto'")

    # -- resolution ---------------------------------------------------------------------------------
    def create_config(self, model_path: str | None = None, tokenizer_path: str | None = None,
                      cuda_available: bool = False) -> AserveConfig:
        """Validate and resolve. `model_path` is the local HF folder the loader resolved `model` to."""
        self._validate_choices()
        self._validate_numbers()
        self._reject_unimplemented()
        path = model_path or self.model
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"--model: no config.json in {path!r}")
        hf_cfg = json.loads(cfg_file.read_text())
        overrides = dict(self.hf_overrides or {})
        if self.rope_theta is not None:
            overrides["rope_theta"] = self.rope_theta
        if self.rope_scaling is not None:
            overrides["rope_scaling"] = self.rope_scaling
        arch = ArchConfig.from_hf_dict(hf_cfg, overrides)
        if self.disable_sliding_window and arch.sliding_window is not None:
            arch = dataclasses.replace(arch, sliding_window=None)
        from aserve.model_registry_names import SUPPORTED_ARCHITECTURES

        _require(arch.architecture in SUPPORTED_ARCHITECTURES, "model",
                 f"architecture {arch.architecture!r} is not supported; supported: {sorted(SUPPORTED_ARCHITECTURES)}")

        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available else "cpu"
        _require(device != "cuda" or cuda_available, "device", "cuda requested but no CUDA device is available")

        dtype = _resolve_dtype(self.dtype, arch.torch_dtype, device)
        derived_max = _derived_max_model_len(hf_cfg, arch)
        max_model_len = self.max_model_len or derived_max
        _require(max_model_len <= derived_max or bool(arch.rope_scaling), "max_model_len",
                 f"{max_model_len} exceeds the model's maximum context of {derived_max}")

        chunked = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        if self.max_num_batched_tokens is not None:
            max_batched = self.max_num_batched_tokens
        else:
            # vLLM derives this default from the context; on CPUs a step of 2048 prompt tokens takes
            # seconds and stalls every running stream, so the budget is smaller there.
            default_budget = 512 if device == "cpu" else 2048
            max_batched = default_budget if chunked else max(max_model_len, default_budget)
        if not chunked:
            _require(max_batched >= max_model_len, "max_num_batched_tokens",
                     f"({max_batched}) is smaller than max_model_len ({max_model_len}); this would reject "
                     "long prompts. Raise it, lower --max-model-len, or enable chunked prefill")
        _require(max_batched >= self.max_num_seqs or chunked, "max_num_batched_tokens",
                 f"({max_batched}) must be >= max_num_seqs ({self.max_num_seqs})")
        preemption = self.preemption_mode or "recompute"
        if preemption == "swap":
            _require(self.swap_space > 0, "swap_space", "must be > 0 when --preemption-mode=swap")

        if self.served_model_name is None:
            names: tuple[str, ...] = (self.model or _BUNDLED_NAME,)
        elif isinstance(self.served_model_name, str):
            names = (self.served_model_name,)
        else:
            _require(len(self.served_model_name) > 0, "served_model_name", "must name at least one model")
            names = tuple(self.served_model_name)

        attention_backend = self.attention_backend or ("triton" if device == "cuda" else "torch")
        cpu_space = self.cpu_kvcache_space
        if cpu_space is None:
            cpu_space = float(os.environ.get("ASERVE_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", 4)))

        model_cfg = ModelConfig(
            model=self.model,
            model_path=str(path),
            tokenizer=tokenizer_path or self.tokenizer or str(path),
            tokenizer_mode=self.tokenizer_mode,
            revision=self.revision,
            tokenizer_revision=self.tokenizer_revision,
            trust_remote_code=self.trust_remote_code,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            served_model_names=names,
            max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
            arch=arch,
            skip_tokenizer_init=self.skip_tokenizer_init,
        )
        return AserveConfig(
            model=model_cfg,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                swap_space_gb=self.swap_space,
                cpu_offload_gb=self.cpu_offload_gb,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cpu_kvcache_space_gb=cpu_space,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                enable_chunked_prefill=chunked,
                preemption_mode=preemption,
                policy=self.scheduling_policy,
            ),
            load=LoadConfig(load_format=self.load_format, download_dir=self.download_dir),
            device=DeviceConfig(device=device),
            parallel=ParallelConfig(distributed_executor_backend=self.distributed_executor_backend or "uni"),
            runner=RunnerConfig(
                enforce_eager=self.enforce_eager or device != "cuda",
                max_seq_len_to_capture=self.max_seq_len_to_capture,
                attention_backend=attention_backend,
                disable_async_output_proc=self.disable_async_output_proc,
            ),
            observability=ObservabilityConfig(disable_log_stats=self.disable_log_stats),
        )


_BUNDLED_NAME = "SmolLM2-135M-Instruct"


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX-BF16).

    With it, bf16 matmuls run ~4x faster than fp32; without it (e.g. AVX2-only CPUs) torch emulates
    bf16 and it runs ~5x *slower* than fp32, so half precision would be the wrong default there.
    """
    override = os.environ.get("ASERVE_CPU_BF16")
    if override is not None:
        return override.lower() in ("1", "true", "yes")
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str,
                   cpu_bf16: bool | None = None) -> str:
    """vLLM's `auto`: the checkpoint's dtype, with fp32 checkpoints served in half precision.

    On CPU, half precision means bfloat16 (fp16 is slow on CPUs) — but only where the CPU has native
    bf16 units; elsewhere `auto` keeps float32, the fast type there.
    """
    aliases = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
               "float32": "float32"}
    if requested != "auto":
        return aliases[requested]
    ckpt = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}.get(str(checkpoint_dtype or ""), "float32")
    if device != "cpu":
        return "float16" if ckpt == "float32" else ckpt
    if cpu_bf16 is None:
        cpu_bf16 = cpu_has_native_bf16()
    return "bfloat16" if cpu_bf16 else "float32"


def _derived_max_model_len(hf_cfg: dict[str, Any], arch: ArchConfig) -> int:
    length = arch.max_position_embeddings
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "dynamic", "yarn") and "factor" in scaling:
        length = int(length * float(scaling["factor"])) if scaling.get("rope_type") != "llama3" else length
    return length
