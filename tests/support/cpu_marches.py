"""Which portable `-march` builds of aserve's C kernels this CPU can run (tests build several; running an
x86-64-v4 build on an AVX2-only CPU dies of SIGILL and takes the test worker with it)."""

from __future__ import annotations

import pytest

from aserve.config.cpu_features import cpu_flags

MARCH_FLAGS = {"x86-64-v4": {"avx512f", "avx512bw", "avx512dq", "avx512vl"}, "x86-64-v3": {"avx2", "fma", "f16c"},
               "x86-64-v2": {"sse4_2", "popcnt"}}


def skip_unless_this_cpu_runs(march: str) -> None:
    """pytest.skip when this CPU lacks a flag the `march` build needs ("native" always runs)."""
    missing = MARCH_FLAGS.get(march, set()) - cpu_flags()
    if missing:
        pytest.skip(f"this CPU cannot run a {march} build (no {', '.join(sorted(missing))})")
