"""The runner's side of multi-LoRA serving: keeps the adapter manager, makes the step's adapters
resident before the inputs are built, and gives each step its forward context (per-token slots).

Failures that belong to one adapter (its folder vanished after an eviction, its files no longer
parse) fail the requests that use it, alone; the step goes on without them.
"""

from __future__ import annotations

import torch

from aserve.config import LoRAConfig
from aserve.lora.request import LoRARequest
from aserve.model.forward_context import ForwardContext, set_forward_context
from aserve.model.lora.manager import LoRAModelManager
from aserve.runner.input_batch import ModelInputs

_NO_LORA = ForwardContext()


class RunnerLoRA:
    """Owns the `LoRAModelManager` of one model and each request's adapter (by req_id)."""

    def __init__(self, model: torch.nn.Module, config: LoRAConfig, device: torch.device):
        self.manager = LoRAModelManager(model, config, device)
        self.adapters: dict[str, LoRARequest] = {}  # req_id -> its adapter (base-model requests absent)

    # -- adapters ----------------------------------------------------------------------------------
    def add_adapter(self, lora_request: LoRARequest) -> None:
        self.manager.add_adapter(lora_request)

    def remove_adapter(self, lora_int_id: int) -> bool:
        return self.manager.remove_adapter(lora_int_id)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, req_id: str, lora_request: LoRARequest | None) -> None:
        if lora_request is not None:
            self.adapters[req_id] = lora_request

    def remove_request(self, req_id: str) -> None:
        self.adapters.pop(req_id, None)

    def load_missing(self, req_ids: list[str]) -> dict[str, str]:
        """Make sure the host cache holds the adapter of every request in `req_ids` (reloading an
        evicted one from its path). Returns req_id -> why, for the requests whose adapter failed."""
        failed: dict[str, str] = {}
        refused: dict[int, str] = {}
        for req_id in req_ids:
            lora_request = self.adapters.get(req_id)
            if lora_request is None:
                continue
            lora_id = lora_request.lora_int_id
            if lora_id not in refused and not self.manager.has_adapter(lora_id):
                try:
                    self.manager.add_adapter(lora_request)
                except Exception as e:  # noqa: BLE001 - the adapter's files: belongs to its requests
                    refused[lora_id] = f"LoRA adapter {lora_request.lora_name!r} could not be loaded: {e}"
            if lora_id in refused:
                failed[req_id] = refused[lora_id]
        return failed

    def graph_capture_context(self, num_tokens: int):
        """The forward context a CUDA graph of `num_tokens` rows is captured in: the LoRA kernels read
        the manager's static per-token slot buffer, which each replay refills."""
        self.manager.static_token_slots(num_tokens)
        return set_forward_context(ForwardContext(lora=self.manager.static_mapping(num_tokens)))

    def forward_context(self, inputs: ModelInputs) -> ForwardContext:
        """The step's forward context: every token's adapter slot (padding rows: none)."""
        adapters = self.adapters
        if not any(r in adapters for r in inputs.req_ids):
            return _NO_LORA
        token_lora_ids: list[int] = []
        requests: dict[int, LoRARequest] = {}
        for req_id, num in zip(inputs.req_ids, inputs.num_scheduled):
            lora_request = adapters.get(req_id)
            if lora_request is None:
                token_lora_ids.extend([0] * num)
            else:
                token_lora_ids.extend([lora_request.lora_int_id] * num)
                requests[lora_request.lora_int_id] = lora_request
        token_lora_ids.extend([0] * (inputs.input_ids.shape[0] - len(token_lora_ids)))  # padded rows
        return ForwardContext(lora=self.manager.prepare_step(token_lora_ids, requests))

