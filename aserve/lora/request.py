"""`LoRARequest`: which adapter a request runs with, spelled as vLLM spells it.

Plain data (a msgspec struct): it travels with a new request from the scheduler to the runner, which
loads the adapter from `lora_path` when it does not hold it already. `lora_int_id` (>= 1) is the
adapter's identity everywhere below the server: two requests with the same id share prefix-cache
blocks, requests with different ids never do.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """`LoRARequest(lora_name, lora_int_id, lora_path)`; `base_model_name` is what `/v1/models`
    reports as the adapter's parent (None: the served model). `long_lora_max_len` is accepted for
    vLLM's signature and must stay None (LongLoRA is not implemented)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: int | None = None
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 means no adapter), got {self.lora_int_id}")
        if self.long_lora_max_len is not None:
            raise ValueError("long_lora_max_len: LongLoRA adapters are not implemented")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
