"""`EngineArgs`: vLLM's engine arguments (same names and defaults) and their validation.

`EngineArgs.validate()` checks everything that does not need the model's files — types, choices,
ranges, combinations of given values, and arguments that are accepted but not implemented (refused
loudly, never ignored) — and raises `ConfigError` naming the flag. Call it before resolving,
downloading or converting a model. `create_config()` validates too, then reads the model's
config.json and resolves the frozen `AserveConfig` (see aserve/config/resolve.py); nothing
downstream validates these values again.
"""

from __future__ import annotations

import dataclasses
import math
import re
import os
import types
import typing
from dataclasses import dataclass
from typing import Any

from aserve.config.dtype_policy import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES
from aserve.config.compilation import parse_compilation_config
from aserve.config.errors import ConfigError, require
from aserve.config.guided_decoding import resolve_structured_outputs
from aserve.config.kv_scales import validate_kv_scale_args
from aserve.config.lora import validate_lora_args
from aserve.config.model_impl import MODEL_IMPLS, check_transformers_args
from aserve.config.observability import validate_observability_args
from aserve.config.parallel import check_parallel_args
from aserve.config.pooling import validate_pooling_args
from aserve.config.loading import check_loading_args
from aserve.config.quantization import (
    CHECKPOINT_METHODS,
    CPU_ONLY_FLAGS,
    METHOD_ALIASES,
    REFUSED_METHODS,
    SMOOTH_QUANT,
    cuda_refusal,
    normalize_method,
)
from aserve.config.resolve import BUNDLED_MODEL_HUB_ID, resolve_config
from aserve.config.scheduler_args import check_scheduler_args
from aserve.config.schema import AserveConfig, StructuredOutputsConfig
from aserve.config.speculative import validate_speculative_args

LOAD_FORMATS = ("auto", "pt", "safetensors", "dummy", "gguf", "npcache", "tensorizer", "bitsandbytes")
_BLOCK_SIZES = (8, 16, 32, 64, 128)
_PREEMPTION_MODES = (None, "recompute", "swap")
_POLICIES = ("fcfs", "priority")
_DEVICES = ("auto", "cpu", "cuda")
_EXECUTOR_BACKENDS = (None, "uni", "mp", "ray")
_ATTENTION_BACKENDS = (None, "torch", "triton")
_TOKENIZER_MODES = ("auto", "slow", "mistral")
_GENERATION_CONFIG = ("auto", "vllm")
# generation_config.json key -> SamplingParams field (vLLM's --generation-config auto and
# --override-generation-config)
SAMPLING_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# `gguf` is vLLM's name; `int4` / `int8` (weight-only, quantized at load) are aserve extensions; gptq / awq /
# compressed-tensors read a quantized checkpoint (aserve/config/quantization.py, which also holds the aliases);
# smooth_quant (seed 004's name) names a compressed-tensors W8A8 checkpoint.
QUANTIZATION_METHODS = ("gguf", "int4", "int8", *CHECKPOINT_METHODS, *METHOD_ALIASES, SMOOTH_QUANT)
# EngineArgs fields limited to a set of values: (field, allowed, how errors name them; None = the tuple).
_CHOICE_FIELDS: tuple[tuple[str, tuple[Any, ...], str | None], ...] = (
    ("dtype", DTYPE_CHOICES, None),
    ("kv_cache_dtype", KV_CACHE_DTYPE_CHOICES, None),
    ("load_format", LOAD_FORMATS, None),
    ("block_size", _BLOCK_SIZES, None),
    ("preemption_mode", _PREEMPTION_MODES, "'recompute' or 'swap'"),
    ("scheduling_policy", _POLICIES, None),
    ("device", _DEVICES, None),
    ("distributed_executor_backend", _EXECUTOR_BACKENDS, "'uni', 'mp' or 'ray'"),
    ("attention_backend", _ATTENTION_BACKENDS, "'torch' or 'triton'"),
    ("model_impl", MODEL_IMPLS, None),
    ("tokenizer_mode", _TOKENIZER_MODES, "'auto', 'slow' or 'mistral'"),
)


@dataclass
class EngineArgs:
    """vLLM's engine arguments, same names and defaults; `validate()` checks them, `create_config()`
    validates and resolves them against the model's config.json."""

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
    # -O: an int level or {"level": ..., "compile_sizes": [...]} (aserve/config/compilation.py)
    compilation_config: int | str | dict[str, Any] | None = None
    max_seq_len_to_capture: int = 8192
    enable_chunked_prefill: bool | None = None
    preemption_mode: str | None = None
    scheduling_policy: str = "fcfs"
    # How prefills share a step (aserve/core/prefill_limits.py)
    scheduler_delay_factor: float = 0.0
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # 0: none, or 4% of max_model_len with max_num_partial_prefills > 1
    # a `Scheduler` subclass by dotted path (None, or vLLM's default names: aserve's own)
    scheduler_cls: str | None = None
    # multi-step decode (aserve/core/multi_step.py): decode steps per scheduling call, and whether the
    # async engine streams each step's tokens as it runs or all of a call's at its end
    num_scheduler_steps: int = 1
    multi_step_stream_outputs: bool = True
    # schedule the next step while this one runs (aserve/core/steps_in_flight.py); None: on with a worker
    # process (mp, ray) where nothing it cannot combine with is asked for
    async_scheduling: bool | None = None
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
    data_parallel_size: int = 1  # engine replicas behind one server (aserve/engine/data_parallel.py)
    data_parallel_rank: int = 0  # which replica this engine is (set per replica by the data-parallel engine)
    disable_async_output_proc: bool | None = None  # None: off on CPU (as vLLM's CPU backend), else on
    enable_sleep_mode: bool = False  # POST /sleep, /wake_up (aserve/runner/sleep_mode.py)
    attention_backend: str | None = None
    quantization: str | None = None
    disable_sliding_window: bool = False
    # auto: aserve's native class when there is one, else the Transformers backend (aserve/config/model_impl.py)
    model_impl: str = "auto"
    guided_decoding_backend: str = "auto"
    # vLLM's newer spelling: {"backend": "xgrammar", ...}; its backend wins over guided_decoding_backend.
    structured_outputs_config: dict[str, Any] | None = None
    # generation_config.json keys (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)
    # over the sampling defaults --generation-config gives (vLLM's --override-generation-config)
    override_generation_config: dict[str, Any] | None = None
    hf_config_path: str | None = None  # a folder whose config.json is read instead of the model's
    config_format: str = "auto"  # auto = hf: aserve reads Hugging Face config.json only
    # weight files to skip (fnmatch globs on the path inside the model folder; also not downloaded)
    ignore_patterns: str | list[str] = "original/**/*"
    # the Hub revision of a model's remote code: aserve runs no remote code (refused with --trust-remote-code)
    code_revision: str | None = None
    # loader options per --load-format and TP ranks loading at once (aserve/config/loading.py)
    model_loader_extra_config: dict[str, Any] | str | None = None
    max_parallel_loading_workers: int | None = None
    kv_cache_memory_bytes: int | None = None  # the KV cache's size in bytes (beats the fraction-based sizing)
    # fp8 KV-cache scales (aserve/config/kv_scales.py): vLLM's JSON of per-layer scales, or computed on step 1
    quantization_param_path: str | None = None
    calculate_kv_scales: bool = False
    # the server's tokenizer threads (aserve/server/tokenizer_pool.py): 0 or 1 = one; "ray" is refused
    tokenizer_pool_size: int = 0
    tokenizer_pool_type: str = "thread"
    tokenizer_pool_extra_config: dict[str, Any] | None = None
    # a regex: requests may name logits processors whose qualified name matches it (aserve/server/logits_processors.py)
    logits_processor_pattern: str | None = None
    # Multi-LoRA serving (aserve/config/lora.py)
    enable_lora: bool = False
    enable_lora_bias: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"
    lora_extra_vocab_size: int = 256
    fully_sharded_loras: bool = False
    long_lora_scaling_factors: list[float] | None = None  # refused (LongLoRA)
    qlora_adapter_name_or_path: str | None = None
    # What the model serves (aserve/config/pooling.py): generate, or a pooling task
    task: str = "auto"
    runner: str = "auto"
    # {"pooling_type": "MEAN", "normalize": true, ...} over the model's pooling (vLLM's --pooler-config too)
    override_pooler_config: dict[str, Any] | None = None
    # Speculative decoding (aserve/config/speculative.py): {"method": "ngram", "num_speculative_tokens": 4, ...}
    speculative_config: dict[str, Any] | str | None = None
    num_lookahead_slots: int = 0  # KV slots reserved past the scheduled tokens (a draft model's k at least)
    # OpenTelemetry request spans (aserve/config/observability.py, aserve/engine/tracing.py)
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: str | None = None  # model, worker, all (comma-separated)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments; ConfigError naming any that are not engine arguments. vLLM's
        deprecated aliases are mapped and its unimplemented names refused (aserve/config/vllm_compat.py)."""
        from aserve.config.vllm_compat import apply_compat  # noqa: PLC0415

        kwargs = apply_compat(kwargs)
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)

    def validate(self) -> None:
        """Check every argument that can be checked without the model's files; raise ConfigError
        naming the flag (`--block-size: ...`). Reads no model files and starts no download."""
        self._validate_types()
        self._validate_choices()
        self._validate_numbers()
        self._validate_combinations()
        self._reject_unimplemented()
        self.resolved_structured_outputs()
        parse_compilation_config(self.compilation_config)
        validate_lora_args(self)
        validate_pooling_args(self)
        validate_speculative_args(self)
        validate_observability_args(self.otlp_traces_endpoint, self.collect_detailed_traces)
        validate_kv_scale_args(self)

    def create_config(self, model_path: str | None = None, tokenizer_path: str | None = None,
                      cuda_available: bool = False, draft_model_path: str | None = None,
                      num_local_gpus: int | None = None) -> AserveConfig:
        """`validate()`, then resolve against the model. `model_path` is the local HF folder the model
        source resolved `model` to (default: `model` itself); `tokenizer_path` likewise for the
        tokenizer; `draft_model_path` likewise for speculative_config's draft `model`
        (`aserve.config.speculative.draft_model_name`). Raises ConfigError naming the flag or the key."""
        self.validate()
        return resolve_config(self, model_path, tokenizer_path, cuda_available, draft_model_path, num_local_gpus)

    # -- the checks ---------------------------------------------------------------------------------
    def _validate_types(self) -> None:
        for name, tp in typing.get_type_hints(EngineArgs).items():
            value = getattr(self, name)
            require(_has_type(value, tp), name, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")

    def _validate_choices(self) -> None:
        for name, allowed, described in _CHOICE_FIELDS:
            value = getattr(self, name)
            what = described or f"one of {allowed}"
            require(value in allowed, name, f"must be {what}, got {value!r}")
        require(self.generation_config in _GENERATION_CONFIG or os.path.isdir(self.generation_config),
                "generation_config", "must be 'auto', 'vllm' or a folder holding generation_config.json")

    def _validate_numbers(self) -> None:
        for name in ("swap_space", "cpu_offload_gb", "gpu_memory_utilization", "cpu_kvcache_space", "rope_theta"):
            value = getattr(self, name)
            require(value is None or math.isfinite(value), name, f"must be a finite number, got {value}")
        require(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        require(self.max_logprobs >= 0, "max_logprobs", f"must be >= 0, got {self.max_logprobs}")
        check_scheduler_args(self)
        require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}")
        require(self.swap_space >= 0, "swap_space", f"must be >= 0, got {self.swap_space}")
        require(self.cpu_offload_gb >= 0, "cpu_offload_gb", f"must be >= 0, got {self.cpu_offload_gb}")
        require(self.cpu_offload_gb == 0 or not self.enable_sleep_mode, "cpu_offload_gb",
                "cannot be combined with --enable-sleep-mode (waking would bring every offloaded weight back)")
        require(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
                "num_gpu_blocks_override", f"must be >= 1, got {self.num_gpu_blocks_override}")
        require(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
                f"must be >= 1, got {self.max_model_len}")
        require(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
                "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        require(self.max_seq_len_to_capture >= 1, "max_seq_len_to_capture",
                f"must be >= 1, got {self.max_seq_len_to_capture}")
        require(self.cpu_kvcache_space is None or self.cpu_kvcache_space > 0, "cpu_kvcache_space",
                f"must be > 0 GiB, got {self.cpu_kvcache_space}")
        require(self.rope_theta is None or self.rope_theta > 0, "rope_theta", f"must be > 0, got {self.rope_theta}")
        require(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1, "kv_cache_memory_bytes",
                f"must be >= 1 byte, got {self.kv_cache_memory_bytes}")

    def _validate_combinations(self) -> None:
        """Combinations of values the user gave; those involving the model's context length are
        checked again in resolve_config once the model's default is known."""
        require(self.tokenizer_pool_size >= 0, "tokenizer_pool_size", f"must be >= 0, got {self.tokenizer_pool_size}")
        require(self.tokenizer_pool_type == "thread", "tokenizer_pool_type",
                f"aserve's tokenizer pool runs threads ('thread'); {self.tokenizer_pool_type!r} is not implemented")
        require(not self.tokenizer_pool_extra_config, "tokenizer_pool_extra_config", "the thread pool takes no options")
        if self.logits_processor_pattern is not None:
            try:
                re.compile(self.logits_processor_pattern)
            except re.error as e:
                raise ConfigError(f"--logits-processor-pattern: not a regular expression: {e}") from None
        if self.enable_chunked_prefill is False and self.max_num_batched_tokens is not None:
            require(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                    f"({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})")
            if self.max_model_len is not None:
                require(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                        f"({self.max_num_batched_tokens}) is smaller than max_model_len ({self.max_model_len}); "
                        "this would reject long prompts. Raise it, lower --max-model-len, or enable chunked prefill")
        if self.preemption_mode == "swap":
            require(self.swap_space > 0, "swap_space", "must be > 0 when --preemption-mode=swap")
        if isinstance(self.served_model_name, list):
            require(len(self.served_model_name) > 0, "served_model_name", "must name at least one model")
        if self.model_impl == "transformers":  # with auto, resolve_config checks once the backend is chosen
            check_transformers_args(self)

    def _reject_unimplemented(self) -> None:
        """Accepted-but-unimplemented arguments fail loudly here instead of being ignored."""
        check_parallel_args(self)
        require(normalize_method(self.quantization) not in REFUSED_METHODS, "quantization",
                f"{self.quantization!r}: {REFUSED_METHODS.get(normalize_method(self.quantization) or '')}")
        require(self.quantization is None or self.quantization in QUANTIZATION_METHODS, "quantization",
                f"{self.quantization!r} is not implemented; implemented: {QUANTIZATION_METHODS} (CPU only)")
        if self.quantization == "gguf":
            source = os.path.expanduser(self.model)
            require(self.model in ("", BUNDLED_MODEL_HUB_ID) or source.endswith(".gguf") or os.path.isdir(source),
                    "quantization",
                    f"'gguf' needs a .gguf model (a file, a folder holding one, or no --model for the bundled one); "
                    f"got --model {self.model!r}")
            require(self.load_format in ("auto", "gguf"), "quantization",
                    f"'gguf' reads the GGUF file's weights; it cannot be combined with --load-format {self.load_format}")
        # vLLM's older spelling of bitsandbytes: --load-format bitsandbytes implies --quantization bitsandbytes
        # (resolve_config), and takes no other method.
        require(self.load_format != "bitsandbytes" or normalize_method(self.quantization) in (None, "bitsandbytes"),
                "load_format", f"'bitsandbytes' reads bitsandbytes weights; it cannot be combined with "
                f"--quantization {self.quantization}")
        require(self.load_format != "bitsandbytes" or self.device != "cuda", "quantization", cuda_refusal("bitsandbytes"))
        if normalize_method(self.quantization) in CPU_ONLY_FLAGS:  # the others: resolve_config, by checkpoint
            require(self.device != "cuda", "quantization", cuda_refusal(self.quantization))
        self.sampling_overrides()
        check_loading_args(self)

    def resolved_ignore_patterns(self) -> tuple[str, ...]:
        """--ignore-patterns as a tuple (vLLM accepts one string or a list)."""
        value = self.ignore_patterns
        return (value,) if isinstance(value, str) else tuple(value)

    def sampling_overrides(self) -> dict[str, Any]:
        """--override-generation-config as SamplingParams fields; ConfigError naming the flag for an
        unknown key (the values are checked against SamplingParams by the engine builder, since the
        config package does not import the sampling layer)."""
        given = self.override_generation_config or {}
        unknown = set(given) - set(SAMPLING_DEFAULT_KEYS)
        require(not unknown, "override_generation_config",
                f"unknown key(s) {sorted(unknown)}; known (generation_config.json's names): "
                f"{sorted(SAMPLING_DEFAULT_KEYS)}")
        return {SAMPLING_DEFAULT_KEYS[k]: v for k, v in given.items() if v is not None}


    def resolved_guided_decoding_backend(self) -> str:
        """The bare backend name ("auto" | "xgrammar" | "guidance"); see `resolved_structured_outputs`."""
        return self.resolved_structured_outputs().backend

    def resolved_structured_outputs(self) -> StructuredOutputsConfig:
        """--guided-decoding-backend and --structured-outputs-config as one config
        (aserve/config/guided_decoding.py's `resolve_structured_outputs`)."""
        return resolve_structured_outputs(self.guided_decoding_backend, self.structured_outputs_config)


def _has_type(value: Any, tp: Any) -> bool:
    """Whether `value` fits the field annotation `tp` (bool is not an int; an int is a float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "") if typing.get_args(tp) else tp.__name__

