"""The plain data that crosses the scheduler -> runner boundary (and the executor's pipe).

Only ids, ints, floats and lists: msgspec structs that encode with msgpack. The runner never
sees a Request object; it keeps its own per-request state keyed by `req_id`.

Protocol, per step:
  * `new_requests`: requests the runner has not seen (or resumed after a recompute preemption):
    full token ids (prompt + outputs so far), sampling params, the full block table,
    `num_computed_tokens` (> 0 on a prefix-cache hit) and the LoRA adapter, if any. The scheduler
    never runs more than `max_loras` distinct adapters in one step. A pooling request carries
    `pooling_params`: when its prompt is fully computed the runner pools it instead of sampling
    (`RunnerOutput.pooled_outputs`) and the scheduler finishes it.
  * `cached_requests`: requests the runner already holds; only what changed: blocks appended
    to the block table and the current `num_computed_tokens` (with pipeline parallelism also the
    step's input tokens once past the prompt: the stages before the last do not sample).
  * `scheduled_req_ids[i]` gets `num_scheduled_tokens[i]` tokens this step, starting at its
    `num_computed_tokens`. A request samples when, after this step, every one of its tokens is
    computed (computed + scheduled == len(prompt) + len(outputs) + its scheduled drafts).
  * Speculative decoding: `scheduled_spec_token_ids[req_id]` are draft tokens appended after the
    request's last token this step (they count in `num_scheduled_tokens`); the runner verifies them
    and returns the accepted drafts plus one token of its own (`RunnerOutput.sampled_token_ids`).
    With `propose_drafts` the runner proposes drafts for the next step for every request that
    sampled (`RunnerOutput.draft_token_ids`); the scheduler decides how many it schedules.
  * `finished_req_ids`: finished, aborted or preempted since the last step: the runner drops them
    before doing anything else.
  * Multi-step decode: `decode_steps[req_id]` (only when every scheduled request decodes one token)
    asks the runner to run that many decode steps back to back, each step's sampled token the next
    one's input, in KV slots the request already holds. Its `RunnerOutput` then carries up to that
    many tokens per request; streamed, the runner reports each step as its own `RunnerOutput` (with
    `decode_step` set) before the call returns the last.
  * Pipeline parallelism (`SchedulerConfig.max_steps_in_flight` > 1): several steps are in flight at
    once, and a request is in at most one of them (it is scheduled again only after its step's
    output went through `update`).
  * `blocks_to_swap_out` / `blocks_to_swap_in`: (src, dst) block ids the runner applies before the
    forward pass (swap_out: device -> cpu, swap_in: cpu -> device). Only full blocks are ever shared,
    so no copy-on-write is needed.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from aserve.lora.request import LoRARequest
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after a preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids_for_min_tokens: list[int]  # EOS + stop_token_ids, masked while len(outputs) < min_tokens
    lora_request: LoRARequest | None = None  # the adapter (the runner loads it from its path if it lacks it)
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled


class CachedRequestData(msgspec.Struct, array_like=True):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # pipeline parallel: the step's input tokens from `num_computed_tokens` on, once past the prompt (the
    # stages before the last never see sampled tokens otherwise); empty without pipeline parallelism
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True):
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    scheduled_req_ids: list[str]
    num_scheduled_tokens: list[int]
    finished_req_ids: list[str]
    blocks_to_swap_out: list[tuple[int, int]] = []
    blocks_to_swap_in: list[tuple[int, int]] = []
    scheduled_spec_token_ids: dict[str, list[int]] = {}  # req_id -> drafts to verify this step
    propose_drafts: bool = False  # the runner proposes drafts for the requests that sample
    # multi-step decode (core/multi_step.py): req_id -> decode steps to run back to back this call
    # (every scheduled request is then decoding one token); empty: one step
    decode_steps: dict[str, int] = {}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_req_ids

    @property
    def needs_runner(self) -> bool:
        """Whether the runner has anything to do: tokens to compute, requests to drop, blocks to swap."""
        return bool(self.scheduled_req_ids or self.finished_req_ids or self.blocks_to_swap_out
                    or self.blocks_to_swap_in)


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Log probabilities at one position: the chosen token first, then the top-N (may repeat it)."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class PooledData(msgspec.Struct, array_like=True):
    """A pooled result: `data` holds `shape`'s float32 values, native byte order, row-major (one
    vector: [dim]; ALL pooling: [num_tokens, dim])."""

    data: bytes
    shape: list[int]


class RunnerOutput(msgspec.Struct, array_like=True):
    """One step's results, in `req_ids` order (only requests that sampled this step).

    `sampled_token_ids[i]`: the tokens request i produced this step: one, or with speculation its
    accepted drafts then one more (at most drafts + 1). `logprobs[i]`: one entry per such token when
    the request asked for logprobs, else []."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs]]
    # req_id -> one entry per prompt position computed this step (position 0 has no logprob, omitted).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # req_id -> why the runner failed that request alone (its logits processor raised, its sampling
    # state could not be built). The runner has dropped the request's state; the scheduler finishes
    # it with finish_reason "error". A failure that cannot be pinned on one request is not reported
    # here: `execute` raises, and the executor treats that as fatal.
    failed_requests: dict[str, str] = {}
    # req_id -> its pooled result: a pooling request whose prompt was fully computed this step (it
    # never samples; the scheduler finishes it with finish_reason "stop").
    pooled_outputs: dict[str, PooledData] = {}
    # req_id -> draft tokens proposed for its next step (only with SchedulerOutput.propose_drafts).
    draft_token_ids: dict[str, list[int]] = {}
    # seconds in the model's forward pass this step (measured only with --collect-detailed-traces model|all)
    forward_time: float = 0.0
    # multi-step decode: the index of the decode step whose tokens this output starts with (0: the
    # call's first step; a streamed later step holds one token per request)
    decode_step: int = 0


class RunnerInfo(msgspec.Struct):
    """What the runner reports once it has loaded the model and sized the KV cache."""

    num_blocks: int
    num_cpu_blocks: int
    block_size: int
    kv_bytes_per_block: int
    device: str
    attention_backend: str


class EngineCoreEventType(IntEnum):
    SCHEDULED = 1  # admitted from the waiting queue (first time, or again after a preemption)
    PREEMPTED = 2


# Sleep mode's parts (vLLM's wake-up tags): the runner's weights and its KV cache.
SLEEP_TAGS = ("weights", "kv_cache")


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """Something the scheduler did to a request, with its wall-clock time (time.time())."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, array_like=True):
    """What `Scheduler.update` reports per request per step (to the engine's output processor)."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = []  # one per new token when logprobs were requested
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # with finish_reason "error": what failed this request (and only it)
    stop_reason: int | str | None = None  # the stop token id (not EOS) that ended it
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    events: list[EngineCoreEvent] = []  # scheduling events since the request's previous output
    pooled: PooledData | None = None  # a pooling request's result (with finish_reason "stop")
