"""Probing the host CPU for features that change which dtype is fast (no torch needed)."""

from __future__ import annotations

import os
import shutil


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX-BF16).

    With it, bf16 matmuls run ~4x faster than fp32; without it (e.g. AVX2-only CPUs) torch emulates
    bf16 and it runs ~5x *slower* than fp32, so half precision would be the wrong default there.
    The environment variable `ASERVE_CPU_BF16` (1/true/yes, anything else = no) overrides the probe;
    an unreadable `cpuinfo` (non-Linux hosts) means no.
    """
    override = os.environ.get("ASERVE_CPU_BF16")
    if override is not None:
        return override.lower() in ("1", "true", "yes")
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16"})


def cpu_bf16_is_fast(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether bf16 models run faster than float32 here: native bf16 units (`cpu_has_native_bf16`, which
    `ASERVE_CPU_BF16` overrides), or AVX2 + FMA + F16C with aserve's C kernels available (a C compiler on
    PATH, not switched off by `ASERVE_CPU_KERNELS=0` / `ASERVE_FORCE_NATIVE_OPS=1`): those multiply bf16
    weights in fp32 FMAs (aserve/kernels/cpu_matmul_avx2.c) and stream half the bytes of float32 ones."""
    if os.environ.get("ASERVE_CPU_BF16") is not None or cpu_has_native_bf16(cpuinfo):
        return cpu_has_native_bf16(cpuinfo)
    # the switches and compiler aserve/kernels/c_build.py reads (config stays free of the kernels package)
    kernels_off = os.environ.get("ASERVE_CPU_KERNELS") == "0" or os.environ.get("ASERVE_FORCE_NATIVE_OPS") == "1"
    compiler = shutil.which(os.environ.get("CC") or "cc") is not None
    return not kernels_off and compiler and {"avx2", "fma", "f16c"} <= cpu_flags(cpuinfo)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first `flags` line of `cpuinfo` as a set (empty when unreadable: non-Linux hosts)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
