"""One request's scheduling state: token ids, progress, status and full-block hashes."""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Iterable

from aserve.core.batch import EngineCoreEvent, EngineCoreEventType, NewRequestData
from aserve.lora.request import LoRARequest
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # recompute-preempted: back in the waiting queue, blocks released
    SWAPPED = 3  # swap-preempted: blocks copied to CPU, in the swapped queue
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        """"stop" | "length" | "abort" | "error" for a finished status, None otherwise."""
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """A request as the scheduler sees it (one sample of an n > 1 request is one Request).

    `num_computed_tokens` counts the leading tokens whose KV is in the cache (or is being computed
    by the step in flight). `block_hashes` holds the hashes of the full blocks of `all_token_ids`
    computed so far (filled lazily by the KV cache manager). `wait_for_req_id` names the leader of
    an n > 1 group: the request is not scheduled until the leader's prompt is computed, so that it
    shares the leader's prompt blocks. `share_prefix` marks members of such a group; their full
    blocks are hashed and shared even when prefix caching is disabled. `client_id` names who sent
    it (a hash of the API key, or None) for fair sharing between clients (`core/fair_queue.py`).
    `lora_request` names the adapter it runs with (None: the base model); its id is mixed into the
    block hashes, so KV is shared between requests of one adapter and never across adapters.
    `pooling_params` marks a pooling request: it finishes when its prompt is computed and pooled
    (its `sampling_params` are the defaults, never used to sample).
    """

    __slots__ = (
        "_all_token_ids",
        "arrival_time",
        "block_hashes",
        "client_id",
        "eos_token_ids",
        "events",
        "lora_request",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "output_token_ids",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "share_prefix",
        "spec_token_ids",
        "status",
        "stop_reason",
        "wait_for_req_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        wait_for_req_id: str | None = None,
        max_model_len: int | None = None,
        share_prefix: bool = False,
        client_id: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.wait_for_req_id = wait_for_req_id
        self.share_prefix = share_prefix
        self.client_id = client_id
        self.lora_request = lora_request
        self.pooling_params = pooling_params
        if sampling_params.max_tokens is not None:
            self.max_tokens = sampling_params.max_tokens
        elif max_model_len is not None:
            self.max_tokens = max(max_model_len - len(prompt_token_ids), 0)
        else:
            self.max_tokens = sys.maxsize
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # tokens being sampled by steps in flight (async scheduling)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self.spec_token_ids: list[int] = []  # drafts the runner proposed for the next step (speculative decoding)
        self.events: list[EngineCoreEvent] = []  # not yet reported in an EngineCoreOutput
        self._all_token_ids = list(prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id (0: the base model)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs; a live list owned by the request (do not mutate)."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.time()))

    def take_events(self) -> list[EngineCoreEvent]:
        events, self.events = self.events, []
        return events

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            token_ids = list(token_ids)
            self.output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """The finished status after `token` was appended (sets stop_reason), or None."""
        params = self.sampling_params
        num_outputs = len(self.output_token_ids)
        if num_outputs >= params.min_tokens:
            if params.stop_token_ids and token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_outputs >= self.max_tokens or self.num_prompt_tokens + num_outputs >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def append_step_tokens(self, tokens: list[int], max_model_len: int) -> tuple[int, RequestStatus | None]:
        """Appends a step's tokens up to the first that finishes the request (the rest are dropped);
        returns how many were kept and the finished status (None: still running)."""
        for n, token in enumerate(tokens, 1):
            self.append_output_token_ids(token)
            status = self.stop_status(token, max_model_len)
            if status is not None:
                return n, status
        return len(tokens), None

    def new_request_data(self, block_ids: list[int]) -> NewRequestData:
        """What the runner needs to start (or resume) this request, holding `block_ids`."""
        params = self.sampling_params
        stop_ids = list(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids.extend(self.eos_token_ids)
        return NewRequestData(
            req_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids), sampling_params=params, block_ids=list(block_ids),
            num_computed_tokens=self.num_computed_tokens, stop_token_ids_for_min_tokens=stop_ids,
            lora_request=self.lora_request, pooling_params=self.pooling_params)

    def __repr__(self) -> str:
        return (f"Request(id={self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"outputs={self.num_output_tokens}, computed={self.num_computed_tokens})")
