"""Which LoRA adapters may run together: at most `max_loras` distinct adapters among the running
requests (each active adapter holds one slot of the runner's stacked LoRA weights).

Admission rule, per step (`start_step` then `can_admit` / `admit` for each candidate in queue order):
a base-model request always fits; a request whose adapter is already running fits; a new adapter
fits while a slot is free. A request that finds no free slot waits (it is never failed), and from
then on in that step no later request of *any* adapter is admitted: the running adapters stop
being fed, drain as their requests finish, and the waiting request gets the first slot that frees.
So no adapter starves another, and base-model requests keep flowing meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable

from aserve.core.request import Request


class LoRASlots:
    """The admission rule above; `max_loras` None means LoRA is off (every request fits)."""

    def __init__(self, max_loras: int | None) -> None:
        self.max_loras = max_loras
        self._active: set[int] = set()
        self._blocked = False

    def start_step(self, running: Iterable[Request]) -> None:
        """Forget the previous step; the adapters of `running` hold their slots."""
        self._active = {req.lora_int_id for req in running if req.lora_int_id}
        self._blocked = False

    def can_admit(self, req: Request) -> bool:
        """Whether `req` may start running now (see the module docstring); a False for want of a slot
        holds back every later adapter request this step."""
        lora_id = req.lora_int_id
        if lora_id == 0 or self.max_loras is None:
            return True
        if self._blocked:
            return False
        if lora_id in self._active or len(self._active) < self.max_loras:
            return True
        self._blocked = True
        return False

    def admit(self, req: Request) -> None:
        """`req` was admitted: its adapter holds a slot from now on."""
        if req.lora_int_id:
            self._active.add(req.lora_int_id)


def adapter_names(requests: Iterable[Request]) -> list[str]:
    """The distinct adapter names of `requests`, sorted (for the LoRA metrics)."""
    return sorted({req.lora_request.lora_name for req in requests if req.lora_request is not None})
