"""The scheduler's stats record, defined once (pure Python: core, engine and server all import it).

`Scheduler.make_stats()` fills it after a step: gauges hold the state now; counters hold what
happened since the previous `make_stats()` (per-step deltas), so a consumer adds them up (a
Prometheus counter `.inc(delta)`) and never has to turn totals back into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    # Gauges (now).
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of usable KV blocks in use, 0..1
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_free_blocks: int = 0  # free blocks still holding a cached prefix (part of the free ones)
    num_cpu_blocks: int = 0  # host blocks for swapping (--preemption-mode swap)
    num_tokens_in_used_blocks: int = 0  # computed tokens held by the running requests' blocks
    running_lora_adapters: list[str] = field(default_factory=list)  # adapter names of running requests
    waiting_lora_adapters: list[str] = field(default_factory=list)  # ... of waiting requests (not running)
    # Counters (deltas since the previous make_stats()).
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0  # running requests preempted
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on


@dataclass(frozen=True)
class InflightRequest:
    """One unfinished engine request (a sample of an n > 1 request is its own) for status pages:
    ids and counts only, never prompt text. `state`: waiting | running | preempted | swapped;
    `arrival_time`: wall clock (time.time()) seconds."""

    request_id: str
    state: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    arrival_time: float


@dataclass
class SpecDecodingStats:
    """Speculative decoding since the previous `make_stats()` (vLLM's spec_decode_* counters):
    requests that verified drafts, drafts verified, drafts accepted, and accepted per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request verified `num_draft_tokens` drafts and accepted the first `num_accepted`."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted:
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1
