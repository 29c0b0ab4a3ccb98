"""`LoRABatchMapping`: which LoRA slot each token of one step uses, in the two forms the kernels need.

  token_slots  int32 `[T]` on the model's device, -1 for a base-model token: the CUDA kernels read
               each token's slot from it (no host data, so a CUDA graph can replay over new values).
  perm         int64 `[N]` (N = tokens with an adapter) on the device: those tokens' indices grouped by
               slot (ascending slot, token order kept inside a slot).
  segments     `((slot, start, end), ...)` host ints over `perm`: the CPU path does one grouped
               matmul per segment (no loop over tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoRABatchMapping:
    """One step's token -> slot mapping (see the module docstring). `num_tokens` is T."""

    token_slots: torch.Tensor
    perm: torch.Tensor
    segments: tuple[tuple[int, int, int], ...]
    num_tokens: int
    _masks: dict = field(default_factory=dict, compare=False, repr=False)  # memo of `masks`

    def masks(self, num_slots: int, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """For the dense CPU path: `[T, num_slots * width]` (1 where a column's slot, `column //
        width`, is the token's) and `[T, num_slots]` (1 at the token's slot); memoized per step, so
        the layers sharing a shape build them once."""
        key = (num_slots, width, dtype)
        found = self._masks.get(key)
        if found is None:
            slots = self.token_slots.to(torch.int64).view(-1, 1)
            slot_mask = (slots == torch.arange(num_slots, device=slots.device)).to(dtype)
            found = (slot_mask.repeat_interleave(width, dim=1), slot_mask)
            self._masks[key] = found
        return found

    @property
    def active_slots(self) -> tuple[int, ...]:
        """The slots some token of this step uses, ascending."""
        return tuple(slot for slot, _, _ in self.segments)


def build_lora_mapping(token_slots: Sequence[int] | torch.Tensor,
                       device: torch.device | str) -> LoRABatchMapping | None:
    """The mapping for per-token slots (`-1` = base model; a host list or CPU tensor), or None when no
    token uses an adapter. Grouping is done with tensor ops on the host copy (no per-token Python)."""
    slots = torch.as_tensor(token_slots, dtype=torch.int64, device="cpu")
    if slots.dim() != 1:
        raise ValueError(f"token_slots: expected one slot per token, got shape {tuple(slots.shape)}")
    used = slots >= 0
    if not bool(used.any()):
        return None
    idx = used.nonzero().squeeze(1)
    order = torch.sort(slots[idx], stable=True)
    perm = idx[order.indices]
    values, counts = torch.unique_consecutive(order.values, return_counts=True)
    ends = counts.cumsum(0).tolist()
    starts = [0, *ends[:-1]]
    segments = tuple(zip(values.tolist(), starts, ends, strict=True))
    return LoRABatchMapping(token_slots=slots.to(device=device, dtype=torch.int32), perm=perm.to(device),
                            segments=segments, num_tokens=int(slots.numel()))
