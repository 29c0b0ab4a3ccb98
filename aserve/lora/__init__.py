"""Multi-LoRA serving: the request type every layer may import (`request.py`, plain data). The
adapter weights, the LoRA-wrapped layers and the slot manager live under `aserve/model/lora/`; the
kernels in `aserve/kernels/lora_ops.py`."""

from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest"]
