"""`LoRAModelManager`: a model's LoRA state on one rank: its wrapped Linear layers, the host cache of
loaded adapters and which adapter occupies each slot of the layers' stacked LoRA buffers.

Two levels, both least-recently-used:
  host cache  at most `max_cpu_loras` adapters loaded from disk (`load_peft_adapter`), host tensors;
              adding one to a full cache evicts the least recently used adapter that is in no slot
              (if every cached adapter holds a slot, the least recently used one: its slot copy stays
              valid, and it is read from its path again if it needs a slot later).
  slots       `max_loras` adapters resident in the layers' buffers (device); `prepare_step` makes the
              step's adapters resident, evicting slots no token of the step uses, least recently
              used first, and copies weights only when a slot's occupant changes.

Per step, the runner calls `prepare_step(token_lora_ids, requests)` and runs the forward inside
`set_forward_context(ForwardContext(lora=mapping))`. With CUDA graphs, the graph is captured with
`static_mapping(n)` and replayed after `fill_static_token_slots(mapping)` (see their docstrings).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from aserve.config import LoRAConfig
from aserve.lora.request import LoRARequest
from aserve.model.layers.linear import Linear
from aserve.model.lora.adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from aserve.model.lora.layers import add_lora_to_layer, clear_slot, set_slot
from aserve.model.lora.mapping import LoRABatchMapping, build_lora_mapping


def _refuse_unsupported_model(model: nn.Module) -> None:
    backend = sys.modules.get("aserve.model.models.transformers_backend")  # never imported: cannot be one
    if backend is not None and isinstance(model, backend.TransformersCausalLM):
        raise ValueError("LoRA adapters need aserve's native model implementation; the Transformers backend "
                         "(--model-impl transformers) cannot take them")


class LoRAModelManager:
    """LoRA for `model` (see the module docstring). On construction every `Linear` of the model (the
    decoder layers' projections; the LM head and MoE experts are other layer types) is wrapped with
    empty slots on `device`. ValueError for a model that cannot take LoRA or `max_cpu_loras < max_loras`."""

    def __init__(self, model: nn.Module, lora_config: LoRAConfig, device: torch.device | str):
        _refuse_unsupported_model(model)
        if lora_config.max_loras < 1 or lora_config.max_cpu_loras < lora_config.max_loras:
            raise ValueError(f"max_loras ({lora_config.max_loras}) must be >= 1 and <= max_cpu_loras "
                             f"({lora_config.max_cpu_loras})")
        self.model = model
        self.lora_config = lora_config
        self.device = torch.device(device)
        self.layers: dict[str, Linear] = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no Linear layers LoRA could wrap")
        for layer in self.layers.values():
            add_lora_to_layer(layer, lora_config, self.device)
        self._cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self._slot_ids = [0] * lora_config.max_loras  # adapter id per slot, 0 = empty
        self._slot_last_used = [0] * lora_config.max_loras  # step counter
        self._step = 0
        self._static_slots: torch.Tensor | None = None

    # -- host cache -------------------------------------------------------------------------------
    def add_adapter(self, request: LoRARequest) -> None:
        """Load `request`'s adapter into the host cache (no-op, but marked recently used, if there);
        may evict another (see the module docstring). Raises LoRAAdapterError; nothing changes then."""
        lora_id = request.lora_int_id
        if lora_id in self._cache:
            self._cache.move_to_end(lora_id)
            return
        adapter = load_peft_adapter(request.lora_path, self.model, self.lora_config)
        while len(self._cache) >= self.lora_config.max_cpu_loras:
            idle = [i for i in self._cache if i not in self._slot_ids]
            del self._cache[idle[0] if idle else next(iter(self._cache))]
        self._cache[lora_id] = adapter

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget the adapter (host cache and any slot it holds). Returns whether it was loaded."""
        found = self._cache.pop(lora_int_id, None) is not None
        for slot, occupant in enumerate(self._slot_ids):
            if occupant == lora_int_id:
                self._clear(slot)
                found = True
        return found

    def has_adapter(self, lora_int_id: int) -> bool:
        """Whether the adapter is loaded (host cache or a slot)."""
        return lora_int_id in self._cache or lora_int_id in self._slot_ids

    def list_adapters(self) -> list[int]:
        """Ids of the loaded adapters (host cache or a slot), ascending."""
        return sorted(set(self._cache) | {i for i in self._slot_ids if i})

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot the adapter occupies, or None."""
        return self._slot_ids.index(lora_int_id) if lora_int_id in self._slot_ids else None

    # -- per step -----------------------------------------------------------------------------------
    def prepare_step(self, token_lora_ids: Sequence[int] | torch.Tensor,
                     requests: Mapping[int, LoRARequest]) -> LoRABatchMapping | None:
        """Make every adapter of this step resident and return the step's mapping (None if every
        token is a base-model token). `token_lora_ids`: one adapter id per token of the step (0 = no
        adapter); `requests`: a `LoRARequest` per id, read only to load an adapter neither in a slot
        nor in the host cache. Raises ValueError for more than `max_loras` distinct adapters, and
        LoRAAdapterError for an adapter that cannot be loaded (or has no request)."""
        ids = torch.as_tensor(token_lora_ids, dtype=torch.int64, device="cpu")
        used = [i for i in torch.unique(ids).tolist() if i != 0]
        if not used:
            return None
        if len(used) > len(self._slot_ids):
            raise ValueError(f"{len(used)} LoRA adapters in one step; max_loras is {len(self._slot_ids)}")
        self._step += 1
        for lora_id in used:  # mark resident ones first so that none of them is evicted below
            if lora_id in self._slot_ids:
                self._slot_last_used[self._slot_ids.index(lora_id)] = self._step
        for lora_id in used:
            if lora_id in self._cache:
                self._cache.move_to_end(lora_id)
            if lora_id in self._slot_ids:
                continue
            if lora_id not in self._cache:
                request = requests.get(lora_id)
                if request is None:
                    raise LoRAAdapterError(f"LoRA adapter {lora_id} is not loaded and the step gives no request "
                                           "(path) for it")
                self.add_adapter(request)
            slot = self._free_slot()
            self._load(slot, lora_id, self._cache[lora_id])
            self._slot_last_used[slot] = self._step
        token_slots = torch.full_like(ids, -1)
        for lora_id in used:  # one pass per adapter (at most max_loras), none per token
            token_slots[ids == lora_id] = self._slot_ids.index(lora_id)
        return build_lora_mapping(token_slots, self.device)

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one no token of this step uses."""
        if 0 in self._slot_ids:
            return self._slot_ids.index(0)
        idle = [s for s in range(len(self._slot_ids)) if self._slot_last_used[s] < self._step]
        return min(idle, key=lambda s: self._slot_last_used[s])  # idle exists: used <= max_loras

    def _load(self, slot: int, lora_id: int, adapter: LoRAAdapter) -> None:
        for name, layer in self.layers.items():
            weights = adapter.modules.get(name)
            if weights is not None:
                set_slot(layer, slot, weights)
            elif layer.lora_ranks[slot]:
                clear_slot(layer, slot)
        self._slot_ids[slot] = lora_id

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            if layer.lora_ranks[slot]:
                clear_slot(layer, slot)
        self._slot_ids[slot] = 0

    # -- CUDA graphs ----------------------------------------------------------------------------------
    def static_token_slots(self, max_tokens: int) -> torch.Tensor:
        """The persistent int32 `[max_tokens]` device buffer of per-token slots a CUDA graph reads
        (all -1 at first; allocated once, grown only by a larger request before any capture). Contract:
        capture every graph inside `set_forward_context(ForwardContext(lora=self.static_mapping(n)))`
        (n = the graph's padded token count), so the LoRA kernels are captured reading this buffer; before
        each replay call `fill_static_token_slots(mapping)` with the step's `prepare_step` result (None
        included). Slot weights are copied into fixed buffers, so replays see adapter swaps too."""
        if self._static_slots is None or self._static_slots.numel() < max_tokens:
            self._static_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=self.device)
        return self._static_slots

    def static_mapping(self, num_tokens: int) -> LoRABatchMapping:
        """A mapping over the first `num_tokens` entries of the static buffer, for graph capture. It has
        no host grouping (`segments` empty): only the CUDA kernels can use it."""
        buffer = self.static_token_slots(num_tokens)
        return LoRABatchMapping(token_slots=buffer[:num_tokens], perm=buffer.new_empty(0, dtype=torch.int64),
                                segments=(), num_tokens=num_tokens)

    def fill_static_token_slots(self, mapping: LoRABatchMapping | None) -> None:
        """Copy a step's slots into the static buffer (`[:T]`), -1 in the rest (padding rows: no delta)."""
        buffer = self._static_slots
        if buffer is None:
            raise RuntimeError("static_token_slots() was never called")
        if mapping is None:
            buffer.fill_(-1)
            return
        num = mapping.num_tokens
        buffer[:num].copy_(mapping.token_slots, non_blocking=True)
        buffer[num:].fill_(-1)
