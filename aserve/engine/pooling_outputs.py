"""The per-step loop over a pooling engine's outputs: each request ends in one step with its pooled
vector (or fails alone), giving one `PoolingRequestOutput` and its stats (prompt tokens, latency).

The same interface as `OutputProcessor` (the engine holds one or the other): a pooling request has
one "sample", its own id.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

from aserve.core.batch import EngineCoreOutput, PooledData
from aserve.engine.output_processor import ProcessedOutputs, record_events
from aserve.engine.stats import FinishedRequestStats, IterationStats
from aserve.outputs import PoolingOutput, PoolingRequestOutput, RequestError, RequestMetrics


@dataclass
class _PoolingState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


def pooled_values(pooled: PooledData) -> list[float] | list[list[float]]:
    """The float32 bytes as Python floats: a list, or one list per row for a 2-D result."""
    values = array("f", pooled.data).tolist()
    if len(pooled.shape) == 2:
        width = pooled.shape[1]
        return [values[i:i + width] for i in range(0, len(values), width)]
    return values


class PoolingOutputProcessor:
    def __init__(self) -> None:
        self.requests: dict[str, _PoolingState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    arrival_time: float) -> list[str]:
        """Registers a request; returns the one scheduler request id to schedule (its own)."""
        self.requests[request_id] = _PoolingState(request_id, prompt, prompt_token_ids,
                                                  RequestMetrics(arrival_time=arrival_time))
        return [request_id]

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def sample_ids(self, request_id: str) -> list[str]:
        return [request_id] if request_id in self.requests else []

    def abort_request(self, request_id: str) -> PoolingRequestOutput | None:
        """Drops a request; its final output has no data and is finished."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        return PoolingRequestOutput(request_id, PoolingOutput([]), state.prompt_token_ids, True, state.prompt,
                                    state.metrics)

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> ProcessedOutputs:
        now = time.time() if now is None else now
        stats = IterationStats()
        results = []
        for out in outputs:
            state = self.requests.pop(out.req_id, None)
            if state is None:
                continue  # aborted meanwhile
            m = state.metrics
            record_events(m, out.events)
            m.finished_time = m.last_token_time = now
            m.num_cached_tokens = out.num_cached_tokens
            error = None
            data: list = []
            raw = b""
            if out.pooled is not None:
                data, raw = pooled_values(out.pooled), out.pooled.data
            else:
                error = RequestError(out.error or "the request failed", bad_input=out.finish_reason == "error")
            results.append(PoolingRequestOutput(state.request_id, PoolingOutput(data), state.prompt_token_ids, True,
                                                state.prompt, m, error, raw))
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            scheduled = m.first_scheduled_time or m.arrival_time
            stats.finished_requests.append(FinishedRequestStats(
                finish_reason="stop" if error is None else "error", e2e_latency=now - m.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids), num_generation_tokens=0, max_tokens_param=None, n=1,
                queue_time=max(scheduled - m.arrival_time, 0.0), prefill_time=max(now - scheduled, 0.0),
                decode_time=0.0, inference_time=max(now - scheduled, 0.0), mean_time_per_output_token=0.0))
        return ProcessedOutputs(results, [], [], stats)
