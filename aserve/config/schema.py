"""The resolved configuration: one frozen dataclass per concern, bundled in `AserveConfig`.

Built only by `EngineArgs.create_config()` (aserve/config/resolve.py), which has already validated
every value, so consumers trust these fields. vLLM arguments that are accepted but not implemented
are refused during validation and never reach these structs. What the runner learns at start-up (the
KV block count) lives in `KVCacheInfo`, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aserve.config.hf_config import ArchConfig
from aserve.config.pooling import PoolingConfig
from aserve.config.loading import LoaderOptions
from aserve.config.quantization import QuantSpec
from aserve.config.observability import ObservabilityConfig
from aserve.config.speculative import SpeculativeConfig

GiB = 1 << 30


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for (name, folder, .gguf path, or "" for the bundled default)
    model_path: str  # the resolved local Hugging Face folder
    tokenizer: str  # resolved local folder (or hub id) for the tokenizer
    tokenizer_revision: str | None
    trust_remote_code: bool
    dtype: str  # resolved: "float32" | "float16" | "bfloat16"
    max_model_len: int
    seed: int
    served_model_names: tuple[str, ...]
    max_logprobs: int
    generation_config: str  # "auto" | "vllm" | a folder holding generation_config.json
    arch: ArchConfig
    skip_tokenizer_init: bool = False
    model_impl: str = "aserve"  # resolved --model-impl: "aserve" (native class) | "transformers" (the fallback)
    # config.json keys the user overrode (--hf-overrides, --rope-theta, --rope-scaling); the Transformers
    # backend sets them on transformers' config object (ArchConfig already has them merged)
    hf_overrides: dict[str, Any] | None = None
    # --override-generation-config: generation_config.json keys over the sampling defaults
    override_generation_config: dict[str, Any] | None = None
    hf_config_path: str | None = None  # the folder config.json was read from (--hf-config-path; None: model_path)
    logits_processor_pattern: str | None = None  # requests may name logits processors matching it (None: none)
    tokenizer_pool_size: int = 0  # the server's tokenizer threads (0 or 1: one)
    tokenizer_mode: str = "auto"  # auto: the fast (Rust) tokenizer; slow: transformers' Python one

    @property
    def served_model_name(self) -> str:
        """The first served name: the one responses report."""
        return self.served_model_names[0]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    swap_space_gb: float = 4.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kvcache_space_gb: float = 4.0  # the KV budget on CPU devices (vLLM: VLLM_CPU_KVCACHE_SPACE)
    kv_cache_memory_bytes: int | None = None  # the KV budget on any device (beats the two above)
    # fp8 KV-cache scales (aserve/config/kv_scales.py): --quantization-param-path's, [tp rank][layer] (one
    # scale for K and V), and --calculate-kv-scales (computed on the first step)
    kv_scales: tuple[tuple[float, ...], ...] | None = None
    calculate_kv_scales: bool = False
    cpu_offload_bytes: int = 0  # --cpu-offload-gb (CUDA): weights kept in host memory (model/weight_offload.py)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    policy: str = "fcfs"
    # how prefills share a step (aserve/core/prefill_limits.py); threshold resolved (0: no cap)
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    scheduler_delay_factor: float = 0.0
    scheduler_cls: str | None = None  # a Scheduler subclass by dotted path (None: aserve's own)
    # KV slots reserved past each request's scheduled tokens: max(--num-lookahead-slots, a draft model's k)
    num_lookahead_slots: int = 0
    # multi-step decode (aserve/core/multi_step.py): decode steps per call; stream each step's tokens
    num_scheduler_steps: int = 1
    multi_step_stream_outputs: bool = True
    # the next step is scheduled and handed to the runner while one runs (aserve/core/steps_in_flight.py)
    async_scheduling: bool = False
    # pipeline parallelism: steps the engine keeps in flight (one per stage), each request in one at most
    max_steps_in_flight: int = 1


@dataclass(frozen=True)
class LoadConfig:
    load_format: str = "auto"
    quantization: str | None = None  # None | "gguf" | "int4" | "int8" | "gptq" | "awq" | "compressed-tensors"
    quant_spec: QuantSpec | None = None  # the checkpoint format's parameters (aserve/config/quantization.py)
    ignore_patterns: tuple[str, ...] = ("original/**/*",)  # weight files not loaded (fnmatch, folder-relative)
    options: LoaderOptions = LoaderOptions()  # --model-loader-extra-config, --max-parallel-loading-workers


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # resolved: "cpu" | "cuda"


@dataclass(frozen=True)
class ParallelConfig:
    """Where the runner lives: `uni` (a thread of this process) or `mp` (worker processes). With
    `tensor_parallel_size` N > 1, `mp` runs one worker per rank (the default then; `uni` is refused).
    With `pipeline_parallel_size` P > 1 there are tp x P ranks, stage by stage (runner/pipeline_stage.py).
    With `data_parallel_size` N > 1 this engine is replica `data_parallel_rank` of N (engine/data_parallel.py):
    on CUDA its ranks use devices rank * W .. rank * W + W - 1 (W = tp x pp); on CPU every rank of every replica
    shares the cores."""

    distributed_executor_backend: str = "uni"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int = 0

    @property
    def world_size(self) -> int:
        """Ranks of one engine (replica): tensor x pipeline parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner executes: graphs, eager fallback, attention backend."""

    enforce_eager: bool = False  # no CUDA graphs (always True off CUDA)
    max_seq_len_to_capture: int = 8192
    attention_backend: str = "torch"  # resolved: "torch" | "triton"
    # CPU: decode batch sizes that run an inductor-compiled forward (-O3; empty: eager everywhere)
    compile_sizes: tuple[int, ...] = ()
    compile_backend: str = "inductor"  # torch.compile backend of the CPU decode
    disable_async_output_proc: bool = False
    enable_sleep_mode: bool = False  # the runner may release its KV cache and weights while idle


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding: the backend a request that names none uses ("auto": xgrammar,
    or guidance for what only it serves; "xgrammar"; "guidance"), and server-wide options every
    request gets (a request may turn them on for itself, not off; see aserve/config/guided_decoding.py):
    compact JSON, objects closed unless the schema says otherwise, no routing to guidance in auto."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (vLLM's LoRA engine arguments). `max_loras` adapters may be active in one
    step (each holds a slot of the stacked LoRA weights); `max_cpu_loras` (>= max_loras) stay loaded in
    host memory, least recently used evicted first. `lora_dtype` is resolved: the model's dtype unless
    set. With `enable_lora` False every other field is ignored and no layer is wrapped."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    lora_dtype: str = "float32"  # resolved: "float32" | "float16" | "bfloat16"
    enable_lora_bias: bool = False
    lora_extra_vocab_size: int = 256  # capacity only: adapters that add tokens are refused at load
    fully_sharded_loras: bool = False


@dataclass(frozen=True)
class AserveConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    load: LoadConfig
    device: DeviceConfig
    parallel: ParallelConfig
    runner: RunnerConfig
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    lora: LoRAConfig = LoRAConfig()
    pooling: PoolingConfig | None = None  # None: a generating model (aserve/config/pooling.py)
    speculative: SpeculativeConfig | None = None  # None: speculation off (aserve/config/speculative.py)
    observability: ObservabilityConfig = ObservabilityConfig()  # tracing (aserve/config/observability.py)

    @property
    def is_pooling(self) -> bool:
        """The engine serves a pooling task (embeddings, classification, scores), not text."""
        return self.pooling is not None


@dataclass(frozen=True)
class KVCacheInfo:
    """What the runner learns at start-up and the scheduler needs: never written back into configs."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
