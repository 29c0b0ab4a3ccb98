"""Helpers shared by the kernel wrappers: launching (CPU tensors through the interpreter), padding, checks.

Triton decides between compiling and interpreting when a function is decorated with `@triton.jit`,
from TRITON_INTERPRET as it is at that moment, and triton.language's own jit'd helpers (`tl.sum`,
`tl.max`, `tl.zeros`, `tl.cdiv`) are decorated when triton is first imported, often by torch or
transformers long before any test sets the variable. So the kernels here call no jit'd helper:
reductions are `tl.reduce` over triton.language's own combine functions (`SUM_COMBINE`,
`MAX_COMBINE`; the interpreter recognizes them and runs numpy), and `launchable` runs any kernel
through the interpreter for CPU tensors. CPU tensors therefore work whatever TRITON_INTERPRET
was at import time; CUDA tensors get the kernel as decorated (compiled unless TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# torch saturates float8_e4m3fn to +-448 on conversion; the kernels clamp to match.
FP8_E4M3_MAX = 448.0


# Combine functions for `tl.reduce(x, axis, SUM_COMBINE)` / `MAX_COMBINE` (same as tl.sum / tl.max on fp32).
SUM_COMBINE = tl.standard._sum_combine
MAX_COMBINE = tl.standard._elementwise_max


def launchable(kernel, device: torch.device):
    """The object to index with a grid and call: the interpreted form for CPU tensors (the only
    way they can run), `kernel` as decorated otherwise."""
    if device.type == "cpu" and not isinstance(kernel, InterpretedFunction):
        # InterpretedFunction caches the rewritten function per kernel, so this is cheap per call.
        return InterpretedFunction(kernel.fn)
    return kernel


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on a CUDA device; 1 elsewhere (the interpreter runs programs serially)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def dot_precision(dtype: torch.dtype) -> str | None:
    """`tl.dot` input precision: exact IEEE for fp32 operands (no TF32 rounding); None (Triton's
    default, irrelevant for 16-bit operands) otherwise."""
    return "ieee" if dtype == torch.float32 else None


def check_tensor(
    name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None
) -> None:
    """Raise TypeError/ValueError naming `name` unless `t` is a tensor of `ndim` dims with one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: dtype {str(t.dtype).removeprefix('torch.')} not in ({names})")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """The common device of `tensors`; ValueError naming the odd one out otherwise."""
    items = list(tensors.items())
    device = items[0][1].device
    for name, t in items[1:]:
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, expected {device} like {items[0][0]}")
    return device


def check_scale(name: str, value: float, quantized: bool) -> float:
    """A positive finite fp8 scale; a scale other than 1.0 on an unquantized cache is rejected."""
    value = float(value)
    if not (value > 0.0 and value != float("inf")):
        raise ValueError(f"{name}: must be a positive finite number, got {value}")
    if not quantized and value != 1.0:
        raise ValueError(
            f"{name}: {value} given but the KV cache is not fp8 (scales apply to fp8 caches only)"
        )
    return value


def check_sliding_window(sliding_window: int | None) -> int:
    """0 for no window, else the positive window length (a query at p sees keys in (p - w, p])."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"sliding_window: must be None or a positive int, got {sliding_window!r}")
    return sliding_window
