"""The greedy LM head on CPU: each row's largest logit without streaming the whole bf16 weight.

A decode step that only takes the argmax (greedy requests with nothing else reading the logits:
StepSampler.plain_greedy) reads the head's weight once per token, a fifth of a small model's bytes. The
screen keeps an 8-bit copy of the weight (a scale per 32 values, half the bytes of bf16) and a bound on
how far its products can be from the exact ones (`CpuKernels.screen_q8`, cpu_matmul_q8.c): only the few
columns whose bound reaches the best lower bound can hold the maximum, and only their column groups of
the packed bf16 weight are multiplied exactly, by the same kernel as the full head. So the token is
bitwise the one `argmax(head(hidden))` picks (the first on ties); a row with too many candidates or a
non-finite value, or more than MAX_ROWS rows, make the call return None and the caller computes the logits.
"""

from __future__ import annotations

import torch

from aserve.kernels.cpu_ops import CpuKernels

# A row with more candidates than this is computed in full (a few are typical: its bound is ~1 logit).
MAX_CANDIDATES = 64
# Steps of more rows compute the logits: the 8-bit products go row by row, the bf16 head's in register blocks of
# rows, which wins once a few rows share the weight stream (README, CPU speed II, ninth pass).
MAX_ROWS = 3


class GreedyScreen:
    """The 8-bit copy of a head's weight `[vocab, hidden]` and the argmax over its packed bf16 form."""

    def __init__(self, kernels: CpuKernels, weight: torch.Tensor):
        self.kernels = kernels
        self.q8 = kernels.pack_q8(*kernels.quantize_q8(weight))

    @staticmethod
    def fits(kernels: CpuKernels, weight: torch.Tensor) -> bool:
        """Whether a head of `weight`'s shape can be screened here (8-bit products, 32-aligned shape)."""
        vocab, hidden = weight.shape
        return kernels.q8_products and vocab % 32 == 0 and hidden % 32 == 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.q8)

    def argmax(self, hidden: torch.Tensor, vnni_weight: torch.Tensor) -> list[int] | None:
        """Each row of `hidden` (bf16 `[M, hidden]`)'s argmax of `hidden @ W^T` as `linear_vnni(hidden,
        vnni_weight)` computes it, or None (see the module docstring)."""
        tokens = self.kernels.greedy_q8(hidden, self.q8, vnni_weight, MAX_CANDIDATES)
        return None if min(tokens) < 0 else tokens
