"""`--calculate-kv-scales` in the runner: the first executed step (not the profile run or a warm-up) runs
eagerly with every attention layer computing its fp8 KV scales from that step's K/V
(aserve/model/kv_scales.py); decode graphs / the compiled decode are captured only after it, so they hold
those scales, and a reload (sleep level 2) gets the same scales back."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from aserve.model.kv_scales import arm_calculation, layer_scales, set_layer_scales

logger = logging.getLogger(__name__)


class KVScaleCalculation:
    """Whether the calculation is still pending, the scales it computed, and a deferred capture."""

    def __init__(self, enabled: bool):
        self.pending = enabled
        self.calculated: list[tuple[float, float]] | None = None
        self.capture_deferred = False

    def restore(self, model: torch.nn.Module) -> None:
        """After a reload: the scales computed before, if any."""
        if self.calculated is not None:
            set_layer_scales(model, self.calculated, "calculated")

    def defer_capture(self) -> bool:
        """True (and remembered) when capturing must wait for the first step."""
        if self.pending:
            self.capture_deferred = True
        return self.pending

    def first_step(self, model: torch.nn.Module, forward: Callable[[], torch.Tensor], capture: Callable[[], None],
                   num_tokens: int) -> torch.Tensor:
        """Run `forward()` computing every layer's scales, keep them, then `capture()` if it was deferred."""
        self.pending = False
        arm_calculation(model)
        hidden = forward()
        self.calculated = layer_scales(model)
        ks, vs = [k for k, _ in self.calculated], [v for _, v in self.calculated]
        logger.info("--calculate-kv-scales: fp8 KV scales of %d layers from the first step (%d tokens): k %.3g..%.3g, "
                    "v %.3g..%.3g", len(ks), num_tokens, min(ks), max(ks), min(vs), max(vs))
        if self.capture_deferred:
            self.capture_deferred = False
            capture()
        return hidden
