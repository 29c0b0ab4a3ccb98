"""The adapters the engine knows by name and id: the server resolves a request's `model` here, the
offline `LLM` registers each `LoRARequest` it is given. Loading goes through the executor (the runner
checks the folder and keeps the weights); the registry only records what loaded.

Contract: a name and an id each denote one adapter; registering the same (name, id, path) again is a
no-op, reusing a name or an id for another adapter is a LoRAAdapterError. An id stays bound to its
adapter after unregistering (prefix-cache blocks are keyed by id, so a new adapter under an old id
could be served the old adapter's KV): `next_id` never hands it out again, and registering another
adapter under it is refused. The registry may hold more
adapters than the runner keeps loaded (`max_cpu_loras`): the runner reloads an evicted one from its
path when a request needs it.
"""

from __future__ import annotations

from collections.abc import Callable

from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, enabled: bool, max_loras: int) -> None:
        self.enabled = enabled
        self.max_loras = max_loras  # adapters active at once (for the metrics)
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}
        self._retired: dict[int, LoRARequest] = {}  # unregistered, their ids still bound to them
        self._next_id = 1

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def get_by_id(self, lora_int_id: int) -> LoRARequest | None:
        return self._by_id.get(lora_int_id)

    def list(self) -> list[LoRARequest]:
        """The registered adapters, in registration order."""
        return list(self._by_name.values())

    def next_id(self) -> int:
        """A fresh id, never handed out or used before (so concurrent callers get different ones)."""
        self._next_id = max(self._next_id, *self._by_id, *self._retired, 0) + 1
        return self._next_id - 1

    def is_registered(self, lora_request: LoRARequest) -> bool:
        """True for exactly this adapter; LoRAAdapterError when its name or id denotes another one."""
        self.check_enabled()
        by_name = self._by_name.get(lora_request.lora_name)
        by_id = self._by_id.get(lora_request.lora_int_id) or self._retired.get(lora_request.lora_int_id)
        if by_name is not None and by_name.lora_int_id != lora_request.lora_int_id:
            raise LoRAAdapterError(f"lora_name {lora_request.lora_name!r} is already the adapter with "
                                   f"lora_int_id {by_name.lora_int_id}")
        if by_id is not None and (by_id.lora_name, by_id.lora_path) != (lora_request.lora_name, lora_request.lora_path):
            raise LoRAAdapterError(f"lora_int_id {lora_request.lora_int_id} is already adapter {by_id.lora_name!r} "
                                   f"({by_id.lora_path})")
        return by_name is not None

    def register(self, lora_request: LoRARequest, load: Callable[[LoRARequest], None]) -> bool:
        """Load (`load`: the executor's add_lora) and record the adapter; False if it was already
        registered (nothing loaded). Raises LoRAAdapterError."""
        if self.is_registered(lora_request):
            return False
        load(lora_request)
        self._retired.pop(lora_request.lora_int_id, None)
        self._by_name[lora_request.lora_name] = lora_request
        self._by_id[lora_request.lora_int_id] = lora_request
        return True

    def unregister(self, name: str) -> LoRARequest | None:
        """Forget the adapter named `name`; the one forgotten, or None if none has that name."""
        lora_request = self._by_name.pop(name, None)
        if lora_request is not None:
            self._retired[lora_request.lora_int_id] = self._by_id.pop(lora_request.lora_int_id)
        return lora_request

    def check_enabled(self) -> None:
        if not self.enabled:
            raise LoRAAdapterError("LoRA adapters are not enabled: start the engine with --enable-lora "
                                   "(LLM(enable_lora=True))")
