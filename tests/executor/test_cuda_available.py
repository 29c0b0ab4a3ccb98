"""`cuda_available` answers like torch without importing torch (the server process never imports it)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from aserve.executor.base import _torch_build_info, cuda_available


def test_agrees_with_torch():
    assert cuda_available() == torch.cuda.is_available()
    build = _torch_build_info()
    assert build is not None and build["cuda"] == torch.version.cuda and build["__version__"] == torch.__version__


def test_a_cpu_build_is_answered_without_importing_torch():
    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("a CUDA build asks the driver (without torch too, but a device may exist)")
    code = "import sys; from aserve.executor.base import cuda_available; print(cuda_available(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
