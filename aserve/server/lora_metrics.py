"""The LoRA metrics: vLLM's `lora_requests_info` gauge and seed 004's `lora_count` and
`lora_time_e2e_requests` counters, kept in the app's own registry (see `metrics.py`), named under
the server's metrics prefix (`vllm` or `aserve`).

`<prefix>:lora_requests_info` has one series at a time, labelled with the adapters of the running and
of the waiting requests (comma-separated names, sorted) and `max_lora`; its value is the time of the
last update. `<prefix>:lora_count` counts finished requests per adapter (`lora_name`) and
`<prefix>:lora_time_e2e_requests` sums their end-to-end seconds.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge


class LoRAMetrics:
    def __init__(self, model_name: str, max_loras: int, registry: CollectorRegistry, prefix: str = "vllm"):
        self.model_name = model_name
        self.max_loras = str(max_loras)
        self.info = Gauge(f"{prefix}:lora_requests_info", "Running and waiting LoRA adapters (value: update time).",
                          ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=registry)
        self.count = Counter(f"{prefix}:lora_count", "Finished requests per LoRA adapter.",
                             ["model_name", "lora_name"], registry=registry)
        self.time_e2e = Counter(f"{prefix}:lora_time_e2e_requests",
                                "End-to-end seconds of finished requests per LoRA adapter.",
                                ["model_name", "lora_name"], registry=registry)
        self._last: tuple[str, str] | None = None
        self.record_adapters([], [])

    def record_adapters(self, running: list[str], waiting: list[str]) -> None:
        labels = (",".join(running), ",".join(waiting))
        if labels != self._last:  # one series: the current state
            self.info.clear()
            self._last = labels
        self.info.labels(running_lora_adapters=labels[0], waiting_lora_adapters=labels[1],
                         max_lora=self.max_loras).set_to_current_time()

    def record_finished(self, req: Any) -> None:
        if req.lora_name is None:
            return
        self.count.labels(model_name=self.model_name, lora_name=req.lora_name).inc()
        self.time_e2e.labels(model_name=self.model_name, lora_name=req.lora_name).inc(req.e2e_latency)
