"""Which floating-point dtype the model runs in: the `--dtype` names and vLLM's `auto` policy.

Dtypes are named by strings here ("float32" | "float16" | "bfloat16"); the one table from these
names to torch dtypes is `aserve.model.loader.torch_dtype` (config never imports torch).
"""

from __future__ import annotations

from aserve.config.cpu_features import cpu_bf16_is_fast

# --dtype spelling -> resolved dtype name.
_DTYPE_ALIASES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
                  "float32": "float32"}
DTYPE_CHOICES = ("auto", *_DTYPE_ALIASES)
RESOLVED_DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def resolve_dtype(requested: str, checkpoint_dtype: str | None, device: str, cpu_bf16: bool | None = None) -> str:
    """The resolved dtype name for `--dtype requested` (one of DTYPE_CHOICES).

    An explicit dtype is taken as asked. `auto` is vLLM's on GPUs: the checkpoint's dtype, with
    float32 (or unknown) checkpoints served in float16. On CPU `auto` ignores the checkpoint's dtype:
    bfloat16 where bf16 is fast here (`cpu_bf16`, probed by `cpu_bf16_is_fast` when None: native bf16
    units, or AVX2 + FMA with aserve's C kernels), float32 elsewhere (fp16 is slow on CPUs, and
    torch's emulated bf16 is slower than float32).
    """
    if requested != "auto":
        return _DTYPE_ALIASES[requested]
    ckpt = str(checkpoint_dtype or "")
    ckpt = ckpt if ckpt in RESOLVED_DTYPES else "float32"
    if device != "cpu":
        return "float16" if ckpt == "float32" else ckpt
    if cpu_bf16 is None:
        cpu_bf16 = cpu_bf16_is_fast()
    return "bfloat16" if cpu_bf16 else "float32"
