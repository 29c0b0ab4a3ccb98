"""Attention-backend tests: CUDA tensors when a GPU is present, else CPU tensors through Triton's interpreter.

The kernel wrappers run CPU tensors through the interpreter whatever TRITON_INTERPRET was when
triton was imported (see aserve/kernels/triton_utils.py); setting it here too, only when there
is no GPU, makes any other jit'd function decorated later interpreted as well.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)
