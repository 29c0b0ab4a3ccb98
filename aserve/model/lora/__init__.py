"""Multi-LoRA serving, the model side (issue 21).

  mapping.py   LoRABatchMapping: one step's token -> slot mapping (`build_lora_mapping`)
  layers.py    LoRALinearMethod: wraps any Linear method, adds the per-token LoRA delta; slot buffers
  adapter.py   load_peft_adapter: a PEFT folder -> per-layer A/B tensors (validated, scaling folded in)
  manager.py   LoRAModelManager: wraps a model's Linear layers, host LRU cache, slot residency per step

The kernels are in `aserve/kernels/lora_ops.py`; the per-step context in `aserve/model/forward_context.py`.
"""

from aserve.model.lora.adapter import LoRAAdapter, LoRAAdapterError, load_peft_adapter
from aserve.model.lora.layers import (
    LoRALinearMethod,
    LoRAShardWeights,
    add_lora_to_layer,
    clear_slot,
    set_slot,
)
from aserve.model.lora.manager import LoRAModelManager
from aserve.model.lora.mapping import LoRABatchMapping, build_lora_mapping

__all__ = [
    "LoRAAdapter", "LoRAAdapterError", "LoRABatchMapping", "LoRALinearMethod", "LoRAModelManager",
    "LoRAShardWeights", "add_lora_to_layer", "build_lora_mapping", "clear_slot", "load_peft_adapter", "set_slot",
]
