"""aserve's C kernel for the multi-LoRA delta of a CPU step (bf16), built at first use and called via ctypes.

`lora_cpu.c` (next to this file, sharing `cpu_common.h`) adds every token's own adapter delta into a
layer's output in one call: tokens grouped by slot, each slot's shrink and expand on its own tokens
only (no work on other slots' columns, no per-slot torch ops). It is built like `cpu_ops.py`'s
kernels: the system C compiler (`$CC`, else `cc`) for this CPU (`-march=native`), cached in
`$ASERVE_CACHE_DIR/kernels` keyed by source, compiler, flags and CPU, and switched off by the same
`ASERVE_CPU_KERNELS=0` / `ASERVE_FORCE_NATIVE_OPS=1`.

`load()` returns None (and LoRA layers keep their torch paths) when there is no compiler, the build
fails or the kernels are switched off; the reason is logged once. The wrapper checks what keeps the
C side inside its buffers; the C side trusts it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from aserve.kernels.c_build import compile_library, kernels_disabled, log_once

_HERE = Path(__file__).parent
_SOURCE = _HERE / "lora_cpu.c"
_HEADER = _HERE / "cpu_common.h"
_BF16 = torch.bfloat16
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = (_P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I)


def build(march: str = "native") -> LoRAKernel:
    """Compile (or reuse from the cache) the kernel for `-march=<march>` and load it; raises OSError (no
    compiler, cannot load) or CalledProcessError (the compiler failed). Tests build portable ISAs
    (`x86-64-v2`, `x86-64-v3`) to check the code paths without AVX512."""
    return LoRAKernel(compile_library("lora_cpu", (_SOURCE,), (_HEADER,), march))


def load() -> LoRAKernel | None:
    """The compiled kernel, or None where it is switched off or cannot be built here (logged once)."""
    if kernels_disabled():
        return None
    return _load_native()


@functools.cache
def _load_native() -> LoRAKernel | None:
    try:
        return build("native")
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()[:500]
        log_once(logging.WARNING, f"LoRA CPU kernel: cannot build ({detail}); LoRA uses torch ops")
        return None


class LoRAKernel:
    """Typed wrapper over the compiled `lora_delta_bf16` (see lora_cpu.c for its contract)."""

    def __init__(self, library: ctypes.CDLL):
        self._delta = library.lora_delta_bf16
        self._delta.argtypes, self._delta.restype = _ARGTYPES, ctypes.c_int64

    @staticmethod
    def accepts(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor) -> bool:
        """Whether this step can use the kernel: bf16 x and LoRA weights, bf16 or float32 y, all on the
        CPU with unit stride within rows, and not being traced by torch.compile."""
        return (x.dtype == _BF16 and lora_a.dtype == _BF16 and y.dtype in (_BF16, torch.float32) and x.is_cpu
                and y.is_cpu and x.stride(-1) == 1 and y.stride(-1) == 1 and not torch.compiler.is_compiling())

    def lora_delta(self, x: torch.Tensor, token_slots: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor,
                   lora_b_tiles: torch.Tensor, slices: torch.Tensor, y: torch.Tensor,
                   lora_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Adds `B[s] @ (A[s] @ x[t])` (+ `lora_bias[s]`) into `y[t]` in place for every token t of slot
        `s = token_slots[t]` (-1, or any value outside `[0, S)`: nothing added) and returns y.

        x `[T, K]` bf16 (unit stride within rows); token_slots int32 `[T]` contiguous; lora_a `[S, R * n, K]`
        bf16 contiguous, rank-major as in `lora_ops`; ranks int64 `[S]` contiguous (slot s uses its first
        `ranks[s]` ranks of every shard; 0: the slot adds nothing, not even its bias); lora_b_tiles
        `[S, ceil(OUT / 16), R, 16]` bf16 contiguous, each slot's B from `tile_b`; slices int64 `[n]`
        contiguous, the shards' output rows summing to OUT (no column past OUT is touched); y `[T, OUT]`
        bf16 or float32 (unit stride within rows, not overlapping any input); lora_bias `[S, OUT]` bf16
        contiguous. fp32 arithmetic (the shrink is not rounded), y rounded once.
        ValueError when the shapes, dtypes or layouts do not fit."""
        num_tokens, k = x.shape
        num_slots, width, _ = lora_a.shape
        max_rank, out = lora_b_tiles.shape[2], y.shape[1]
        num_shards = slices.shape[0]
        if (lora_a.shape[2] != k or lora_b_tiles.shape != (num_slots, -(-out // 16), max_rank, 16)
                or num_shards < 1 or width != max_rank * num_shards or y.shape[0] != num_tokens
                or token_slots.shape != (num_tokens,) or ranks.shape != (num_slots,)
                or not (x.is_cpu and y.is_cpu and lora_a.is_cpu and lora_b_tiles.is_cpu and token_slots.is_cpu)
                or x.dtype != _BF16 or lora_a.dtype != _BF16 or lora_b_tiles.dtype != _BF16
                or y.dtype not in (_BF16, torch.float32) or token_slots.dtype != torch.int32
                or ranks.dtype != torch.int64 or slices.dtype != torch.int64 or x.stride(1) != 1 or y.stride(1) != 1
                or not (lora_a.is_contiguous() and lora_b_tiles.is_contiguous() and token_slots.is_contiguous()
                        and ranks.is_contiguous() and slices.is_contiguous())):
            raise ValueError(f"lora_delta: x {tuple(x.shape)} / lora_a {tuple(lora_a.shape)} / lora_b_tiles "
                             f"{tuple(lora_b_tiles.shape)} / y {tuple(y.shape)} {y.dtype} do not fit")
        if lora_bias is not None and (lora_bias.shape != (num_slots, out) or lora_bias.dtype != _BF16
                                      or not lora_bias.is_contiguous() or not lora_bias.is_cpu):
            raise ValueError(f"lora_delta: lora_bias {tuple(lora_bias.shape)} must be bf16 [{num_slots}, {out}]")
        if self._delta(x.data_ptr(), x.stride(0), token_slots.data_ptr(), num_tokens, lora_a.data_ptr(),
                       ranks.data_ptr(), lora_b_tiles.data_ptr(), slices.data_ptr(),
                       None if lora_bias is None else lora_bias.data_ptr(), y.data_ptr(), y.stride(0),
                       y.dtype == torch.float32, num_slots, max_rank, num_shards, k, out):
            raise MemoryError("lora_delta: out of memory")
        return y


def slice_array(output_slices: Sequence[int]) -> torch.Tensor:
    """`output_slices` as the int64 tensor `lora_delta` takes."""
    return torch.tensor(list(output_slices), dtype=torch.int64)


def tile_b(lora_b: torch.Tensor) -> torch.Tensor:
    """One slot's `lora_b [OUT, R]` in the layout `lora_delta` reads, `[ceil(OUT / 16), R, 16]`: tiles of
    16 output rows, each tile's R x 16 block contiguous (`tiles[o // 16, j, o % 16] = lora_b[o, j]`, zero
    past OUT), so the expand streams B in order."""
    out, rank = lora_b.shape
    padded = torch.zeros(-(-out // 16) * 16, rank, dtype=lora_b.dtype, device=lora_b.device)
    padded[:out] = lora_b
    return padded.view(-1, 16, rank).transpose(1, 2).contiguous()
