"""Whether Triton's interpreter runs here: CPU tensors go through it (`aserve/kernels/triton_utils.launchable`).

Triton 3.6's interpreter turns a kernel's int argument into a 1-element numpy array and indexes a
`range()` with `int(array)`, which numpy 2.5 refuses ("only 0-dimensional arrays can be converted to
Python scalars"); later Triton releases squeeze the array first. A CUDA image can pair the two (seen on
the GPU machine: triton 3.6.0, numpy 2.5.2), and there every CPU-tensor kernel call fails inside
Triton. `requires_interpreter` skips a test that runs kernels on CPU tensors in that case, naming it;
everywhere else (CI included) the test runs."""

from __future__ import annotations

import functools

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

from aserve.kernels.triton_utils import launchable


@triton.jit
def _count_kernel(out_ptr, n):
    total = 0
    for _ in range(0, n, 1):
        total += 1
    tl.store(out_ptr, total)


@functools.cache
def interpreter_failure() -> str | None:
    """None where the interpreter runs a loop over a runtime int; else why not."""
    out = torch.zeros(1, dtype=torch.int32)
    try:
        launchable(_count_kernel, out.device)[(1,)](out, 3)
    except InterpreterError as e:  # the interpreter wraps numpy's TypeError in it
        return f"Triton {triton.__version__}'s interpreter fails here: {e!r}"
    return None if int(out[0]) == 3 else f"Triton {triton.__version__}'s interpreter counted {int(out[0])}, not 3"


def requires_interpreter() -> None:
    """Skip the calling test where Triton's interpreter cannot run CPU tensors (see the module docstring)."""
    failure = interpreter_failure()
    if failure is not None:
        pytest.skip(failure)
