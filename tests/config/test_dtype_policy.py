"""resolve_dtype: explicit dtypes as asked; vLLM's `auto` on GPUs, the fast type on CPUs."""

from __future__ import annotations

import pytest

from aserve.config import DTYPE_CHOICES, resolve_dtype


@pytest.mark.parametrize("requested, checkpoint, device, cpu_bf16, want", [
    ("auto", "float32", "cpu", True, "bfloat16"),
    ("auto", "bfloat16", "cpu", True, "bfloat16"),
    ("auto", "float16", "cpu", True, "bfloat16"),
    ("auto", "float32", "cpu", False, "float32"),
    ("auto", "bfloat16", "cpu", False, "float32"),
    ("auto", "float32", "cuda", None, "float16"),
    ("auto", None, "cuda", None, "float16"),
    ("auto", "bfloat16", "cuda", None, "bfloat16"),
    ("auto", "float16", "cuda", None, "float16"),
    ("half", "bfloat16", "cuda", None, "float16"),
    ("float16", "float32", "cpu", False, "float16"),
    ("bfloat16", "float32", "cpu", False, "bfloat16"),
    ("float", "bfloat16", "cpu", True, "float32"),
    ("float32", "float16", "cuda", None, "float32"),
])
def test_resolve_dtype(requested, checkpoint, device, cpu_bf16, want):
    assert resolve_dtype(requested, checkpoint, device, cpu_bf16=cpu_bf16) == want


def test_every_choice_resolves():
    assert set(DTYPE_CHOICES) == {"auto", "half", "float16", "bfloat16", "float", "float32"}
    for name in DTYPE_CHOICES:
        assert resolve_dtype(name, "float32", "cuda") in ("float32", "float16", "bfloat16")
