"""Test doubles for aserve.core: a fake runner that follows the SchedulerOutput protocol and checks
that the KV cache it is told to use holds the right contents, plus small constructors."""

from __future__ import annotations

from collections.abc import Callable

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.core.batch import RunnerOutput, SchedulerOutput, TokenLogprobs
from aserve.core.request import Request
from aserve.core.scheduler import Scheduler
from aserve.sampling_params import SamplingParams

VOCAB = 50


def next_token(tokens: list[int]) -> int:
    """The deterministic 'model': the next token depends only on the sequence so far."""
    return (len(tokens) * 7 + sum(tokens[-3:]) * 3) % VOCAB


def reference_outputs(prompt: list[int], max_tokens: int, max_model_len: int, eos: tuple[int, ...] = (),
                      token_fn: Callable[[list[int]], int] = next_token) -> list[int]:
    """What a request generates when nothing interferes (greedy, no stop strings)."""
    tokens = list(prompt)
    out: list[int] = []
    while True:
        t = token_fn(tokens)
        tokens.append(t)
        out.append(t)
        if t in eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class _RunnerRequest:
    def __init__(self, tokens: list[int], num_prompt: int, block_ids: list[int], num_computed: int,
                 params: SamplingParams):
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.params = params
        self.fingerprints: list[int] = []

    def fingerprint(self, pos: int) -> int:
        """An id of tokens[:pos + 1] (what the KV at `pos` depends on)."""
        fps = self.fingerprints
        while len(fps) <= pos:
            prev = fps[-1] if fps else 0
            fps.append(hash((prev, self.tokens[len(fps)])))
        return fps[pos]


class FakeRunner:
    """Keeps per-request state from the protocol alone; 'computes' KV as fingerprints of the prefix.

    Every step it checks: cached requests' num_computed_tokens match its own count, block tables
    cover the scheduled tokens, block 0 is never used, and (after writing this step's KV, as the
    attention backend does) every context position it reads holds the right prefix fingerprint.
    `script[req_id]` lists tokens to emit for that request before falling back to `token_fn`.
    """

    def __init__(self, block_size: int, token_fn: Callable[[list[int]], int] = next_token,
                 script: dict[str, list[int]] | None = None):
        self.block_size = block_size
        self.token_fn = token_fn
        self.script = script or {}
        self.kv: dict[tuple[int, int], int] = {}
        self.cpu_kv: dict[tuple[int, int], int] = {}
        self.reqs: dict[str, _RunnerRequest] = {}
        self.num_steps = 0

    def _copy_block(self, src: dict, src_block: int, dst: dict, dst_block: int) -> None:
        for off in range(self.block_size):
            if (src_block, off) in src:
                dst[(dst_block, off)] = src[(src_block, off)]
            else:
                dst.pop((dst_block, off), None)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        self.num_steps += 1
        bs = self.block_size
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for dev, cpu in so.blocks_to_swap_out:
            self._copy_block(self.kv, dev, self.cpu_kv, cpu)
        for cpu, dev in so.blocks_to_swap_in:
            self._copy_block(self.cpu_kv, cpu, self.kv, dev)
        for new in so.new_requests:
            assert new.req_id not in self.reqs, f"{new.req_id} sent as new twice"
            self.reqs[new.req_id] = _RunnerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens, new.sampling_params)
        for cached in so.cached_requests:
            st = self.reqs[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens, (cached.req_id, st.num_computed,
                                                                   cached.num_computed_tokens)
            st.block_ids.extend(cached.new_block_ids)
        assert len(set(so.scheduled_req_ids)) == len(so.scheduled_req_ids)
        # Write this step's KV for every sequence first (the attention backend's contract) ...
        spans = []
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens):
            st = self.reqs[req_id]
            start, end = st.num_computed, st.num_computed + n
            assert n > 0 and end <= len(st.tokens), (req_id, start, n, len(st.tokens))
            assert len(st.block_ids) * bs >= end, (req_id, st.block_ids, end)
            assert 0 not in st.block_ids, f"{req_id} uses the null block"
            for pos in range(start, end):
                self.kv[(st.block_ids[pos // bs], pos % bs)] = st.fingerprint(pos)
            spans.append((req_id, st, start, end))
        # ... then attend: every position up to `end` must hold this sequence's prefix.
        req_ids, sampled, logprobs = [], [], []
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        for req_id, st, start, end in spans:
            for pos in range(end):
                got = self.kv.get((st.block_ids[pos // bs], pos % bs))
                assert got == st.fingerprint(pos), f"{req_id}: wrong KV at position {pos}"
            st.num_computed = end
            if st.params.prompt_logprobs is not None:
                positions = range(max(start, 1), min(end, st.num_prompt))
                if positions:
                    prompt_logprobs[req_id] = [TokenLogprobs([st.tokens[p]], [-1.0], [p]) for p in positions]
            if end == len(st.tokens):
                script = self.script.get(req_id)
                token = script.pop(0) if script else self.token_fn(st.tokens)
                st.tokens.append(token)
                req_ids.append(req_id)
                sampled.append([token])
                logprobs.append([TokenLogprobs([token], [-0.5], [1])] if st.params.logprobs is not None else [])
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 8, max_model_len: int = 64, enable_chunked_prefill: bool = True,
                   enable_prefix_caching: bool = True, policy: str = "fcfs", preemption_mode: str = "recompute",
                   num_cpu_blocks: int = 0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                        preemption_mode=preemption_mode, policy=policy),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        KVCacheInfo(num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_size=block_size),
    )


def make_request(req_id: str, prompt: list[int] | int, *, max_tokens: int | None = 4, eos: tuple[int, ...] = (),
                 arrival_time: float | None = None, priority: int = 0, max_model_len: int | None = None,
                 wait_for_req_id: str | None = None, share_prefix: bool = False, client_id: str | None = None,
                 **params) -> Request:
    if isinstance(prompt, int):
        prompt = [(i * 5 + 1) % VOCAB for i in range(prompt)]
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   eos_token_ids=eos, arrival_time=0.0 if arrival_time is None else arrival_time,
                   priority=priority, wait_for_req_id=wait_for_req_id, max_model_len=max_model_len,
                   share_prefix=share_prefix, client_id=client_id)


class Driver:
    """Runs schedule -> FakeRunner.execute -> update, collecting outputs per request."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner | None = None):
        self.scheduler = scheduler
        self.runner = runner or FakeRunner(scheduler.block_size)
        self.tokens: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.stop_reasons: dict[str, int | str | None] = {}
        self.outputs: list = []

    def step(self):
        so = self.scheduler.schedule()
        ro = self.runner.execute(so)
        outs = self.scheduler.update(so, ro)
        for out in outs:
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish_reasons[out.req_id] = out.finish_reason
                self.stop_reasons[out.req_id] = out.stop_reason
        self.outputs.extend(outs)
        return so, outs

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: {list(self.scheduler.requests.values())}")
