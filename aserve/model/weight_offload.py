"""`--cpu-offload-gb` (CUDA): part of the weights lives in pinned host memory and is streamed to the
device layer by layer, in every forward pass (vLLM's meaning: a virtual way to enlarge the GPU).

Whole decoder layers are offloaded, first to last, until the budget is reached (the layer that
crosses it included, as vLLM does). An offloaded layer's parameters hold pinned CPU tensors between
forward passes; a forward pre-hook copies them to the device (asynchronously, from pinned memory)
and points the parameters at the copies, and a forward hook points them back at the host tensors,
so the device copies are freed (to the caching allocator) once the layer has run. Only
`nn.Parameter`s move: tensors a quantization method keeps as plain attributes stay on the device.
Because the device copies are new tensors every pass, CUDA graphs cannot replay them: the
configuration turns graphs off (eager decode) when offloading. Limitation: the loader loads the whole
model onto the device first and the layers move to host memory afterwards, so the device must hold
the full model once at start-up; the budget lowers the steady state (more room for the KV cache), it
does not yet let a model larger than the device load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from aserve.config import GiB

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadReport:
    num_layers: int  # decoder layers offloaded
    num_bytes: int  # parameter bytes now in host memory


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList | None:
    """The model's stack of decoder layers: the first ModuleList of `num_layers` modules that hold
    parameters (families name it `layers`, `h` or `layer`), or None."""
    for module in model.modules():
        if (isinstance(module, nn.ModuleList) and len(module) == num_layers and num_layers > 0
                and all(any(True for _ in m.parameters()) for m in module)):
            return module
    return None


def offload_weights(model: nn.Module, num_layers: int, max_bytes: int, device: torch.device,
                    pin_memory: bool = True) -> OffloadReport:
    """Moves the parameters of decoder layers (first to last) to host memory until `max_bytes` are
    offloaded, and hooks each such layer to run on `device` copies (module docstring). `pin_memory`:
    page-locked host tensors (needs CUDA). ValueError if the model has no recognisable layer stack."""
    layers = decoder_layers(model, num_layers)
    if layers is None:
        raise ValueError("--cpu-offload-gb: this model has no stack of decoder layers to offload")
    done = OffloadReport(0, 0)
    for layer in layers:
        if done.num_bytes >= max_bytes:
            break
        params = list(layer.parameters())
        moved = _move_to_host(params, pin_memory)
        layer.register_forward_pre_hook(_StreamIn(params, device))
        layer.register_forward_hook(_StreamOut(params, moved))
        done = OffloadReport(done.num_layers + 1, done.num_bytes + sum(t.numel() * t.element_size() for t in moved))
    logger.info("--cpu-offload-gb: %d of %d decoder layers (%.2f GiB of weights) kept in %s host memory, "
                "streamed to %s each forward pass", done.num_layers, len(layers), done.num_bytes / GiB,
                "pinned" if pin_memory else "pageable", device)
    return done


def _move_to_host(params: list[nn.Parameter], pin_memory: bool) -> list[torch.Tensor]:
    hosts = []
    for p in params:
        host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin_memory)
        host.copy_(p.data)
        p.data = host
        hosts.append(host)
    return hosts


class _StreamIn:
    """Forward pre-hook: the layer's parameters point at fresh device copies of their host tensors."""

    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.params = params
        self.device = device

    def __call__(self, module: nn.Module, args) -> None:
        for p in self.params:
            p.data = p.data.to(self.device, non_blocking=True, copy=True)


class _StreamOut:
    """Forward hook: the layer's parameters point back at their host tensors."""

    def __init__(self, params: list[nn.Parameter], hosts: list[torch.Tensor]):
        self.params = params
        self.hosts = hosts

    def __call__(self, module: nn.Module, args, output) -> None:
        for p, host in zip(self.params, self.hosts):
            p.data = host
