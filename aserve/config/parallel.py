"""Tensor and pipeline parallelism at the config level (standard library only): the checks a model and
the other flags must pass for `--tensor-parallel-size N` / `--pipeline-parallel-size P`, and each
rank's view of the architecture (its heads and widths, its stage's layers).

A rank builds the model from `rank_arch_config(arch, N)`: attention heads, KV heads and MLP widths
divided by N (KV heads replicated when there are fewer than N), the rest unchanged, so model files
(which read sizes from `ArchConfig`) build this rank's slice without knowing about ranks. The vocabulary
is not divided: the embedding and LM head are split by the loader, padding the last rank's share
(`ceil(vocab / N)` rows each), so no vocabulary size is refused.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from typing import Any

from aserve.config.errors import require
from aserve.config.families import MoeFields
from aserve.config.hf_config import SUPPORTED_ARCHITECTURES, ArchConfig

_FLAG = "tensor_parallel_size"


def check_tensor_parallel(arch: ArchConfig, tp_size: int) -> None:
    """ConfigError naming --tensor-parallel-size unless every size a rank splits divides by `tp_size`:
    attention heads, KV heads (or `tp_size` a multiple of them: each KV head is then replicated on
    `tp_size / num_kv_heads` ranks, as vLLM does), the MLP's intermediate size, and for MoE families
    each expert's and the shared expert's width."""
    if tp_size == 1:
        return
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    require(heads % tp_size == 0, _FLAG, f"{tp_size} does not divide the model's {heads} attention heads")
    require(kv_heads % tp_size == 0 or tp_size % kv_heads == 0, _FLAG,
            f"{tp_size} neither divides the model's {kv_heads} KV heads nor is a multiple of them "
            "(with fewer KV heads than ranks each KV head is replicated, which needs a whole number per head)")
    require(arch.intermediate_size % tp_size == 0, _FLAG,
            f"{tp_size} does not divide the model's intermediate_size {arch.intermediate_size}")
    fields = arch.family
    if isinstance(fields, MoeFields):
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            size = getattr(fields, name)
            require(size % tp_size == 0, _FLAG, f"{tp_size} does not divide the model's {name} {size}")


def kv_head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many ranks hold each KV head (1 unless there are fewer KV heads than ranks)."""
    return tp_size // num_kv_heads if tp_size > num_kv_heads else 1


def rank_arch_config(arch: ArchConfig, tp_size: int) -> ArchConfig:
    """One rank's view of `arch` (already checked by `check_tensor_parallel`); `arch` itself at tp=1."""
    if tp_size == 1:
        return arch
    fields = arch.family
    if isinstance(fields, MoeFields):
        fields = dataclasses.replace(fields, moe_intermediate_size=fields.moe_intermediate_size // tp_size,
                                     shared_expert_intermediate_size=fields.shared_expert_intermediate_size // tp_size)
    return dataclasses.replace(
        arch, num_attention_heads=arch.num_attention_heads // tp_size,
        num_key_value_heads=max(1, arch.num_key_value_heads // tp_size),
        intermediate_size=arch.intermediate_size // tp_size, family=fields)


def default_executor_backend(given: str | None, world_size: int, device: str, num_local_gpus: int | None) -> str:
    """`--distributed-executor-backend` as given, else vLLM's default: `ray` when the ranks outnumber this
    machine's GPUs (`num_local_gpus`, when known) and Ray is installed, `mp` with several ranks, `uni`
    with one (the async engine asks for `mp` with one rank itself)."""
    if given is not None:
        return given
    if (device == "cuda" and num_local_gpus is not None and world_size > num_local_gpus
            and importlib.util.find_spec("ray") is not None):
        return "ray"
    return "mp" if world_size > 1 else "uni"


def pipeline_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Stage `pp_rank`'s contiguous layers [start, end) of `num_layers` split over `pp_size` stages as
    evenly as possible (the first `num_layers % pp_size` stages hold one more)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def stage_arch_config(arch: ArchConfig, pp_rank: int, pp_size: int) -> ArchConfig:
    """Pipeline stage `pp_rank`'s view of `arch`: its layers only (`first_layer`, `num_hidden_layers`);
    `arch` itself with one stage."""
    if pp_size == 1:
        return arch
    start, end = pipeline_layer_range(arch.num_hidden_layers, pp_rank, pp_size)
    return dataclasses.replace(arch, first_layer=start, num_hidden_layers=end - start,
                               total_layers=arch.num_hidden_layers)


_PP = "pipeline_parallel_size"
# Architectures whose decoder splits into stages (model/pipeline.py: embedding, layers, final norm, with the
# residual stream between layers); GPT-2 and OPT add learned positions to the embedding and are not split.
PIPELINE_ARCHITECTURES = SUPPORTED_ARCHITECTURES - {"GPT2LMHeadModel", "OPTForCausalLM"}


def check_parallel_args(args: Any) -> None:
    """ConfigError naming the flag unless the parallelism flags (`EngineArgs`) are sizes >= 1 in a
    combination that is built: tensor and pipeline parallelism run over `mp` or `ray` (one worker per
    rank); data-parallel replicas without LoRA or sleep mode."""
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        require(getattr(args, name) >= 1, name, f"must be >= 1, got {getattr(args, name)}")
    check_pipeline_args(args)
    require(0 <= args.data_parallel_rank < args.data_parallel_size, "data_parallel_rank",
            f"must be in [0, --data-parallel-size={args.data_parallel_size}), got {args.data_parallel_rank}")
    if args.data_parallel_size > 1:
        require(not args.enable_lora, "data_parallel_size",
                "LoRA adapters are not supported with data-parallel replicas yet (use 1 with --enable-lora)")
        require(not args.enable_sleep_mode, "data_parallel_size",
                "sleep mode is not supported with data-parallel replicas yet (use 1 with --enable-sleep-mode)")
    if args.tensor_parallel_size > 1:
        require(args.distributed_executor_backend in (None, "mp", "ray"), "distributed_executor_backend",
                f"--tensor-parallel-size {args.tensor_parallel_size} runs one worker per rank: it needs "
                "'mp' (processes of this machine) or 'ray' (actors on a Ray cluster), not 'uni'")
        require(args.quantization != "gguf", "quantization",
                "'gguf' serves the file's 4-bit blocks whole; it cannot be split across tensor-parallel "
                "ranks (use --tensor-parallel-size 1, or int8/int4, which quantize each rank's slice)")


def check_pipeline_args(args: Any) -> None:
    """ConfigError naming the flag for what `--pipeline-parallel-size` > 1 does not combine with (the
    engine arguments alone; the model is checked by `check_pipeline_parallel`)."""
    pp = args.pipeline_parallel_size
    if pp == 1:
        return
    require(args.distributed_executor_backend in (None, "mp", "ray"), "distributed_executor_backend",
            f"--pipeline-parallel-size {pp} runs one worker per rank: it needs 'mp' or 'ray', not "
            f"{args.distributed_executor_backend!r}")
    refused = [
        ("speculative_config", args.speculative_config is not None, "speculative decoding"),
        ("num_scheduler_steps", args.num_scheduler_steps > 1, "multi-step decode"),
        ("enable_lora", args.enable_lora, "LoRA adapters"),
        ("enable_sleep_mode", args.enable_sleep_mode, "sleep mode"),
        ("cpu_offload_gb", args.cpu_offload_gb > 0, "weight offloading"),
        ("quantization", args.quantization == "gguf", "'gguf' (its blocks are read by the whole model's names)"),
    ]
    for flag, given, what in refused:
        require(not given, flag, f"{what} is not implemented with --pipeline-parallel-size > 1")


def check_pipeline_parallel(arch: ArchConfig, pp_size: int) -> None:
    """ConfigError naming --pipeline-parallel-size unless the model splits into `pp_size` stages of at
    least one layer each."""
    if pp_size == 1:
        return
    require(arch.architecture in PIPELINE_ARCHITECTURES, _PP,
            f"{arch.architecture} is not split into pipeline stages (supported: {sorted(PIPELINE_ARCHITECTURES)})")
    require(arch.num_hidden_layers >= pp_size, _PP,
            f"{pp_size} stages need at least {pp_size} layers; the model has {arch.num_hidden_layers}")
