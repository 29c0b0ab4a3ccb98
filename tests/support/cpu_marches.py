"""Which portable `-march` builds of aserve's C kernels this CPU can run (tests build several; running an
x86-64-v4 build on an AVX2-only CPU dies of SIGILL and takes the test worker with it)."""

from __future__ import annotations

import platform
import subprocess

import pytest

from aserve.config.cpu_features import cpu_flags

MARCH_FLAGS = {"x86-64-v4": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "x86-64-v3": {"avx2", "fma", "f16c"},
               "x86-64-v2": {"sse4_2", "popcnt"}}


def skip_unless_this_cpu_runs(march: str) -> None:
    """pytest.skip when this CPU lacks a flag the `march` build needs ("native" always runs)."""
    missing = MARCH_FLAGS.get(march, set()) - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run a {march} build (no {', '.join(sorted(missing))})")


# "native" plus, on x86, the portable x86-64-v3 (AVX2) and x86-64-v2 (SSE) builds: the code paths other CPUs take
MARCHES = ["native"] + (["x86-64-v3", "x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else [])


def build_cpu_kernels(march: str):
    """aserve's C kernels built for `march` (`cpu_ops.build`); pytest.skip where this CPU cannot run that
    build or the compiler cannot make it."""
    from aserve.kernels import cpu_ops

    skip_unless_this_cpu_runs(march)
    try:
        return cpu_ops.build(march)
    except (OSError, subprocess.CalledProcessError) as e:  # e.g. a compiler without that -march
        pytest.skip(f"cannot build for {march}: {e}")
