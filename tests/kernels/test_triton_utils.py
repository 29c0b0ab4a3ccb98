"""Shared wrapper helpers: padding sizes, argument checks, and the CPU-needs-interpreter error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aserve.kernels.triton_utils import check_scale, check_sliding_window, next_power_of_2
from tests.support.triton_interpreter import requires_interpreter


def test_next_power_of_2():
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 64, 80, 96, 129)] == [1, 1, 2, 4, 64, 128, 128, 256]


def test_check_sliding_window():
    assert check_sliding_window(None) == 0
    assert check_sliding_window(4096) == 4096
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            check_sliding_window(bad)


def test_check_scale():
    assert check_scale("k_scale", 0.5, quantized=True) == 0.5
    assert check_scale("k_scale", 1.0, quantized=False) == 1.0
    with pytest.raises(ValueError, match="v_scale: 2.0 given but the KV cache is not fp8"):
        check_scale("v_scale", 2.0, quantized=False)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="k_scale"):
            check_scale("k_scale", bad, quantized=True)


def test_cpu_tensors_run_even_if_triton_was_imported_compiled():
    """torch/transformers often import triton before any test can set TRITON_INTERPRET; the
    kernels must still run CPU tensors (through the interpreter) and get the right answer."""
    requires_interpreter()
    code = (
        "import triton.language as tl, torch\n"
        "assert type(tl.sum).__name__ == 'JITFunction'\n"
        "from aserve.kernels import reference\n"
        "from aserve.kernels.rms_norm import rms_norm\n"
        "from aserve.kernels.paged_decode_attention import paged_decode_attention\n"
        "x, w = torch.randn(3, 40), torch.randn(40)\n"
        "assert torch.allclose(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), atol=1e-5)\n"
        "cache, q = torch.randn(2, 4, 8, 1, 64), torch.randn(2, 2, 64)\n"
        "table, lens = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([9, 16], dtype=torch.int32)\n"
        "for splits in (1, 2):\n"
        "    got = paged_decode_attention(q, cache, table, lens, 0.125, num_splits=splits)\n"
        "    assert torch.allclose(got, reference.paged_decode_attention(q, cache, table, lens, 0.125), atol=1e-5)\n"
        "print('OK')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.stdout.strip() == "OK", out.stdout + out.stderr
