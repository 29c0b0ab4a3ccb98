"""Per-device forms of a layer op (vLLM's CustomOp idea).

A `CustomOp` layer defines `forward_native` (pure torch, the reference, correct on any device) and
may define `forward_cpu` / `forward_cuda` (faster forms for one device type: fewer or fused ops on
CPU, our Triton kernels on CUDA). The form is chosen once, when the layer is built, from the device
it is built on (the default device, which `torch.device(...)` as a context manager sets, as the model
constructors do) unless `ASERVE_FORCE_NATIVE_OPS=1` asks for the native form everywhere (to compare
paths). CPU forms call aserve's compiled C kernels for bf16 activations where they could be built
(`self.cpu_kernels`). A device form must agree with `forward_native` up to float rounding; tests check each pair.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from aserve.kernels import cpu_ops
from aserve.kernels.cpu_ops import FORCE_NATIVE_ENV

__all__ = ["FORCE_NATIVE_ENV", "CustomOp"]


class CustomOp(nn.Module):
    """Subclasses implement `forward_native` and optionally `forward_<device type>`."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatch_device = torch.get_default_device().type
        self.form = self.choose_form(self.dispatch_device)
        self._impl = getattr(self, f"forward_{self.form}")
        # The compiled C kernels a CPU form may call (None: not built here; see aserve/kernels/cpu_ops.py).
        self.cpu_kernels = cpu_ops.load() if self.form == "cpu" else None

    @classmethod
    def choose_form(cls, device_type: str) -> str:
        """`device_type` when the class has a form for it (and natives are not forced), else `native`."""
        if os.environ.get(FORCE_NATIVE_ENV) == "1":
            return "native"
        return device_type if callable(getattr(cls, f"forward_{device_type}", None)) else "native"

    def forward(self, *args, **kwargs):
        return self._impl(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError
