"""Probing the host CPU for features that change which dtype is fast (no torch needed)."""

from __future__ import annotations

import os


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
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False
