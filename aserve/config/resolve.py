"""Resolving validated `EngineArgs` against the model's config.json into the frozen `AserveConfig`.

Here live the defaults that depend on the model or the device: the context length, the dtype, the
per-step token budget, the attention backend, the served names. Called by `EngineArgs.create_config`
after `EngineArgs.validate()`; the checks left here are the ones that need the model or the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from aserve.config.dtype_policy import resolve_dtype
from aserve.config.compilation import resolve_compilation
from aserve.config.errors import require
from aserve.config.families import normalize_keys
from aserve.config.parallel import check_pipeline_parallel, check_tensor_parallel
from aserve.config.lora import resolve_lora_config
from aserve.config.observability import resolve_observability
from aserve.config.pooling import bare_model_architecture, needs_whole_prompt, resolve_pooling_config, resolve_task
from aserve.config.quantization import (CUDA_METHODS, checkpoint_quantization_config, cuda_refusal,
                                        resolve_quantization)
from aserve.config.kv_scales import resolve_kv_scales
from aserve.config.loading import resolve_loader_options
from aserve.config.parallel import default_executor_backend
from aserve.config.speculative import resolve_num_lookahead_slots, resolve_speculative_config
from aserve.config.model_impl import (
    check_transformers_args,
    choose_model_impl,
    eager_for_transformers,
    transformers_arch_config,
)
from aserve.config.hf_config import (
    ENCODER_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ArchConfig,
    architecture_of,
    derived_max_model_len,
    layer_sliding_windows,
    read_hf_config,
)
from aserve.config.schema import (
    GiB,
    AserveConfig,
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)

if TYPE_CHECKING:
    from aserve.config.engine_args import EngineArgs

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"  # what `model=""` serves (aserve/model_source.py finds its file)
# Its Hub id: `--model` with it resolves to the bundled copy (no network); both names are served.
BUNDLED_MODEL_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# vLLM derives the step budget from the context; on CPUs a step of 2048 prompt tokens takes seconds
# and stalls every running stream, so the budget is smaller there.
_DEFAULT_TOKEN_BUDGET = {"cpu": 512, "cuda": 2048}
# vLLM's default --scheduler-cls values: they mean "the engine's own scheduler"
VLLM_DEFAULT_SCHEDULERS = (None, "vllm.core.scheduler.Scheduler", "vllm.v1.core.sched.scheduler.Scheduler",
                           "aserve.core.scheduler.Scheduler")


def resolve_config(args: EngineArgs, model_path: str | None, tokenizer_path: str | None,
                   cuda_available: bool, draft_model_path: str | None = None,
                   num_local_gpus: int | None = None) -> AserveConfig:
    """The frozen config for already-validated `args`; `model_path` (default `args.model`) is the
    local folder holding config.json; `draft_model_path` the speculative draft's (default: its `model`).
    Raises ConfigError naming the flag or the config.json key."""
    path = model_path or args.model
    config_folder = os.path.expanduser(args.hf_config_path) if args.hf_config_path else None
    hf_cfg = read_hf_config(config_folder or path)
    overrides = dict(args.hf_overrides or {})
    if args.rope_theta is not None:
        overrides["rope_theta"] = args.rope_theta
    if args.rope_scaling is not None:
        overrides["rope_scaling"] = args.rope_scaling
    hf_cfg = {**hf_cfg, **overrides}
    name = architecture_of(hf_cfg)
    causal = bare_model_architecture(name)  # a bare decoder (Qwen2Model) serves through its causal class
    if causal is not None:
        hf_cfg, name = {**hf_cfg, "architectures": [causal]}, causal
    task = resolve_task(args, name, bare_decoder=causal is not None)
    pooling = resolve_pooling_config(args, name, str(path), task, hf_cfg)
    if pooling is not None:  # pooling runs aserve's own classes (encoders, decoder embedders)
        require(args.model_impl != "transformers", "model_impl",
                "pooling models need aserve's native model classes, not the Transformers backend")
        require(name in ENCODER_ARCHITECTURES or name in SUPPORTED_ARCHITECTURES, "model",
                f"architecture {name!r} cannot pool; supported: "
                f"{sorted(ENCODER_ARCHITECTURES | SUPPORTED_ARCHITECTURES)}")
        model_impl = "aserve"
    else:
        model_impl = choose_model_impl(args.model_impl, name, hf_cfg)
    if model_impl == "transformers":
        check_transformers_args(args)
        arch = transformers_arch_config(hf_cfg)
    else:
        arch = ArchConfig.from_hf_dict(hf_cfg, disable_sliding_window=args.disable_sliding_window)
        check_tensor_parallel(arch, args.tensor_parallel_size)
        check_pipeline_parallel(arch, args.pipeline_parallel_size)

    device = args.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    require(device != "cuda" or cuda_available, "device", "cuda requested but no CUDA device is available")
    world_size = args.tensor_parallel_size * args.pipeline_parallel_size
    backend = default_executor_backend(args.distributed_executor_backend, world_size, device, num_local_gpus)
    num_gpus_needed = args.data_parallel_size * world_size
    require(device != "cuda" or num_local_gpus is None or backend == "ray" or num_gpus_needed <= num_local_gpus,
            "data_parallel_size" if args.data_parallel_size > 1 else
            "pipeline_parallel_size" if args.pipeline_parallel_size > 1 else "tensor_parallel_size",
            f"{args.data_parallel_size} replica(s) x {world_size} rank(s) need {num_gpus_needed} "
            f"GPUs; this machine has {num_local_gpus} (--distributed-executor-backend ray spreads ranks over a cluster)")
    require(args.cpu_offload_gb == 0 or device == "cuda", "cpu_offload_gb",
            f"offloads weights from a GPU to CPU memory; on {device} the weights already live in CPU memory")
    # --load-format bitsandbytes (vLLM's older spelling) means --quantization bitsandbytes, weights read as auto.
    bnb_format = args.load_format == "bitsandbytes"
    if bnb_format:
        ckpt = (checkpoint_quantization_config(hf_cfg, str(path)) or {}).get("quant_method")
        require(ckpt in (None, "bitsandbytes"), "load_format",
                f"'bitsandbytes' quantizes a float checkpoint or reads a bitsandbytes one; {path} is a {ckpt!r} "
                "checkpoint: drop --load-format bitsandbytes")
    quantization, quant_spec = resolve_quantization(args.quantization or ("bitsandbytes" if bnb_format else None),
                                                    hf_cfg, str(path), args.tensor_parallel_size)
    require(quantization is None or device == "cpu" or (device == "cuda" and quantization in CUDA_METHODS),
            "quantization", cuda_refusal(quantization or ""))
    require(args.pipeline_parallel_size == 1 or quant_spec is None, "pipeline_parallel_size",
            f"a quantized checkpoint ({quantization}) is not split into pipeline stages yet (only 1); online "
            "--quantization int8 / int4 / fp8 / bitsandbytes of a float checkpoint is")
    require(args.load_format != "tensorizer" or quant_spec is None, "load_format",
            f"'tensorizer' reads float checkpoints; {path} is a {quantization} checkpoint (quantization_config): "
            "serve it with --load-format auto")

    max_model_len = _max_model_len(args, hf_cfg, arch, pooling.pooler.max_seq_length if pooling else None)
    chunked = True if args.enable_chunked_prefill is None else args.enable_chunked_prefill
    prefix_caching = args.enable_prefix_caching
    if pooling is not None and needs_whole_prompt(name, pooling):  # each prompt in one step, no cache hits
        require(args.enable_chunked_prefill is not True, "enable_chunked_prefill",
                f"{name} with {pooling.pooler.pooling_type.value} pooling reads every prompt row in one step; "
                "chunked prefill needs a causal model with LAST pooling")
        chunked, prefix_caching = False, False
    max_batched = args.max_num_batched_tokens
    if max_batched is None:
        budget = _DEFAULT_TOKEN_BUDGET[device]
        max_batched = budget if chunked else max(max_model_len, budget)
    if not chunked:
        require(max_batched >= max_model_len, "max_num_batched_tokens",
                f"({max_batched}) is smaller than max_model_len ({max_model_len}); this would reject "
                "long prompts. Raise it, lower --max-model-len, or enable chunked prefill")
        require(max_batched >= args.max_num_seqs, "max_num_batched_tokens",
                f"({max_batched}) must be >= max_num_seqs ({args.max_num_seqs})")

    cpu_space = args.cpu_kvcache_space
    if cpu_space is None:
        cpu_space = float(os.environ.get("ASERVE_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", 4)))
    model_cfg = ModelConfig(
        model=args.model,
        model_path=str(path),
        tokenizer=tokenizer_path or args.tokenizer or str(path),
        tokenizer_revision=args.tokenizer_revision,
        trust_remote_code=args.trust_remote_code,
        dtype=resolve_dtype(args.dtype, arch.torch_dtype, device),
        max_model_len=max_model_len,
        seed=args.seed,
        served_model_names=_served_model_names(args),
        max_logprobs=args.max_logprobs,
        generation_config=args.generation_config,
        arch=arch,
        skip_tokenizer_init=args.skip_tokenizer_init,
        model_impl=model_impl,
        hf_overrides=overrides or None,
        override_generation_config=dict(args.override_generation_config or {}) or None,
        hf_config_path=config_folder,
        logits_processor_pattern=args.logits_processor_pattern,
        tokenizer_pool_size=args.tokenizer_pool_size,
        tokenizer_mode=args.tokenizer_mode,
    )
    speculative = resolve_speculative_config(args, arch, model_impl=model_impl, is_pooling=pooling is not None,
                                             max_model_len=max_model_len, draft_model_path=draft_model_path)
    # Default on where the step runs in another process. Not with uni: its runner thread shares the GIL with
    # the scheduler (on an H200 the offline 1B run measured 12.7k output tok/s with it, 14.8k without).
    async_scheduling = args.async_scheduling if args.async_scheduling is not None else (
        backend in ("mp", "ray") and speculative is None and args.num_scheduler_steps == 1
        and args.pipeline_parallel_size == 1)
    compilation = resolve_compilation(args.compilation_config, args.enforce_eager, device, args.max_num_seqs)
    if model_impl == "transformers":
        compilation = eager_for_transformers(compilation, device)
    require(pooling is None or not compilation.compile_sizes, "compilation_config",
            "pooling models run no decode steps: the CPU compiled decode (-O3) does not apply; drop -O3")
    require(world_size == 1 or not compilation.compile_sizes, "compilation_config",
            "the CPU compiled decode (-O3) is not implemented with --tensor-parallel-size or "
            "--pipeline-parallel-size > 1; drop -O3")
    return AserveConfig(
        model=model_cfg,
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            swap_space_gb=args.swap_space,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            cpu_kvcache_space_gb=cpu_space,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_scales=resolve_kv_scales(args, hf_cfg.get("model_type"), arch.num_hidden_layers,
                                        args.tensor_parallel_size),
            calculate_kv_scales=args.calculate_kv_scales,
            cpu_offload_bytes=int(args.cpu_offload_gb * GiB),
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_batched,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            preemption_mode=args.preemption_mode or "recompute",
            policy=args.scheduling_policy,
            max_num_partial_prefills=args.max_num_partial_prefills,
            max_long_partial_prefills=args.max_long_partial_prefills,
            long_prefill_token_threshold=args.long_prefill_token_threshold or (
                int(max_model_len * 0.04) if args.max_num_partial_prefills > 1 else 0),
            scheduler_delay_factor=args.scheduler_delay_factor,
            scheduler_cls=None if args.scheduler_cls in VLLM_DEFAULT_SCHEDULERS else args.scheduler_cls,
            num_lookahead_slots=resolve_num_lookahead_slots(args, speculative),
            num_scheduler_steps=args.num_scheduler_steps,
            multi_step_stream_outputs=args.multi_step_stream_outputs,
            async_scheduling=async_scheduling,
            max_steps_in_flight=2 if async_scheduling else args.pipeline_parallel_size,
        ),
        load=LoadConfig(load_format="auto" if bnb_format else args.load_format, quantization=quantization,
                        quant_spec=quant_spec,
                        ignore_patterns=args.resolved_ignore_patterns(),
                        options=resolve_loader_options(args.model_loader_extra_config, args.load_format,
                                                       args.max_parallel_loading_workers)),
        device=DeviceConfig(device=device),
        parallel=ParallelConfig(
            distributed_executor_backend=backend,
            tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
            data_parallel_size=args.data_parallel_size, data_parallel_rank=args.data_parallel_rank),
        runner=RunnerConfig(
            # offloaded weights are copied anew each pass: no CUDA graph can replay them; a later pipeline
            # stage's input arrives through a hook outside any graph (graphs with pipeline parallelism: not built)
            enforce_eager=(compilation.level == 0 or device != "cuda" or args.cpu_offload_gb > 0
                           or args.pipeline_parallel_size > 1),
            compile_sizes=compilation.compile_sizes,
            compile_backend=compilation.backend,
            max_seq_len_to_capture=args.max_seq_len_to_capture,
            attention_backend=args.attention_backend or ("triton" if device == "cuda" else "torch"),
            disable_async_output_proc=(device == "cpu" if args.disable_async_output_proc is None
                                       else args.disable_async_output_proc),
            enable_sleep_mode=args.enable_sleep_mode,
        ),
        structured_outputs=args.resolved_structured_outputs(),
        lora=resolve_lora_config(args, model_cfg.dtype, model_impl),
        pooling=pooling,
        speculative=speculative,
        observability=resolve_observability(args.otlp_traces_endpoint, args.collect_detailed_traces),
    )


def _max_model_len(args: EngineArgs, hf_cfg: dict, arch: ArchConfig, max_seq_length: int | None = None) -> int:
    """`--max-model-len`, else the model's context. With `--disable-sliding-window` on a model that
    has a window, the context is capped at the window (as vLLM does), so full attention computes
    exactly what the windowed model would. A sentence-transformers folder's `max_seq_length` caps it
    too (the length the embedding model was trained to pool)."""
    limit = derived_max_model_len(arch)
    if max_seq_length is not None:
        limit = min(limit, max_seq_length)
    windows = [w for w in layer_sliding_windows(normalize_keys(arch.architecture, hf_cfg), arch.architecture)
               if w] if args.disable_sliding_window else []  # (refused with the Transformers backend)
    if args.disable_sliding_window and windows and min(windows) < limit:
        limit = min(windows)
        require(args.max_model_len is None or args.max_model_len <= limit, "max_model_len",
                f"{args.max_model_len} exceeds the sliding window ({limit}) that --disable-sliding-window "
                "caps the context at")
    max_model_len = args.max_model_len or limit
    require(max_model_len <= limit or bool(arch.rope_scaling), "max_model_len",
            f"{max_model_len} exceeds the model's maximum context of {limit}")
    return max_model_len

def _served_model_names(args: EngineArgs) -> tuple[str, ...]:
    if args.served_model_name is None:
        if args.model == "":  # the bundled model answers to both of its names, the one given first
            return (BUNDLED_MODEL_NAME, BUNDLED_MODEL_HUB_ID)
        if args.model == BUNDLED_MODEL_HUB_ID:
            return (BUNDLED_MODEL_HUB_ID, BUNDLED_MODEL_NAME)
        return (args.model,)
    if isinstance(args.served_model_name, str):
        return (args.served_model_name,)
    return tuple(args.served_model_name)
