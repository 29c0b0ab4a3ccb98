"""LoRA engine arguments (vLLM's names): validated without the model, resolved into `LoRAConfig`.

Implemented: `enable_lora`, `max_loras`, `max_lora_rank`, `max_cpu_loras` (default: `max_loras`, as
vLLM), `lora_dtype`, `enable_lora_bias`, `lora_extra_vocab_size` (a capacity; adapters that add tokens
are refused when loaded, naming the file), `fully_sharded_loras` (with one rank there is nothing to
shard, so it changes nothing). Refused by name: `long_lora_scaling_factors` (LongLoRA),
`qlora_adapter_name_or_path` (QLoRA needs bitsandbytes 4-bit bases), `fully_sharded_loras` with more
than one tensor-parallel rank.
"""

from __future__ import annotations

from typing import Any

from aserve.config.errors import require
from aserve.config.schema import LoRAConfig

LORA_DTYPES = ("auto", "float16", "bfloat16", "float32")
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values


def validate_lora_args(args: Any) -> None:
    """Check the LoRA arguments of `args` (an EngineArgs); ConfigError naming the flag."""
    require(args.long_lora_scaling_factors is None, "long_lora_scaling_factors",
            "LongLoRA adapters (trained with their own rope scaling) are not implemented; drop the flag")
    require(args.qlora_adapter_name_or_path is None, "qlora_adapter_name_or_path",
            "QLoRA needs a bitsandbytes 4-bit base model, which aserve does not load; serve the adapter with "
            "--enable-lora --lora-modules over a full-precision or int4/int8 base instead")
    require(args.lora_dtype in LORA_DTYPES, "lora_dtype", f"must be one of {LORA_DTYPES}, got {args.lora_dtype!r}")
    require(args.max_loras >= 1, "max_loras", f"must be >= 1, got {args.max_loras}")
    require(args.max_lora_rank in _LORA_RANKS, "max_lora_rank",
            f"must be one of {_LORA_RANKS}, got {args.max_lora_rank}")
    require(args.lora_extra_vocab_size >= 0, "lora_extra_vocab_size",
            f"must be >= 0, got {args.lora_extra_vocab_size}")
    if args.max_cpu_loras is not None:
        require(args.max_cpu_loras >= args.max_loras, "max_cpu_loras",
                f"({args.max_cpu_loras}) must be >= max_loras ({args.max_loras})")
    if args.fully_sharded_loras:
        require(args.tensor_parallel_size == 1, "fully_sharded_loras",
                "sharding both halves of the LoRA computation across tensor-parallel ranks is not implemented "
                "(aserve shards B of column-parallel and A of row-parallel layers); drop the flag")


def resolve_lora_config(args: Any, model_dtype: str, model_impl: str) -> LoRAConfig:
    """The frozen LoRA config (the default, disabled one without --enable-lora). `model_dtype` is
    the resolved model dtype ("auto" LoRA weights follow it)."""
    if not args.enable_lora:
        return LoRAConfig()
    require(model_impl != "transformers", "enable_lora",
            "LoRA adapters need aserve's native model classes; this model runs on the Transformers backend "
            "(--model-impl transformers)")
    return LoRAConfig(
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras,
        lora_dtype=model_dtype if args.lora_dtype == "auto" else args.lora_dtype,
        enable_lora_bias=args.enable_lora_bias,
        lora_extra_vocab_size=args.lora_extra_vocab_size,
        fully_sharded_loras=args.fully_sharded_loras,
    )
