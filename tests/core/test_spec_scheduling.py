"""The scheduler with speculative decoding (core/spec_decoding.py, core/scheduler.py), no torch.

A fake runner follows the protocol of `core/batch.py` with drafts: it writes the KV of the last
token and the drafts, checks that every position it reads holds the right prefix (so a rolled-back
slot or a cached block holding a rejected draft is caught), verifies the drafts against the
deterministic 'model' of core_fakes (accept while equal, stop at a stop token), and proposes the next
drafts from an oracle that is sometimes wrong. Outputs must equal the no-speculation reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from aserve.config import CacheConfig, KVCacheInfo, SchedulerConfig
from aserve.config.speculative import SpeculativeConfig
from aserve.core.batch import RunnerOutput, SchedulerOutput, TokenLogprobs
from aserve.core.scheduler import Scheduler
from tests.core.core_fakes import VOCAB, make_request, next_token, reference_outputs


def ngram_spec(k: int = 3, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1,
                             **kw)


def make_spec_scheduler(spec: SpeculativeConfig | None = None, *, num_blocks: int = 64, block_size: int = 4,
                        max_num_batched_tokens: int = 64, max_num_seqs: int = 8, max_model_len: int = 64,
                        enable_prefix_caching: bool = True, num_lookahead_slots: int = 0,
                        preemption_mode: str = "recompute", num_cpu_blocks: int = 0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, num_lookahead_slots=num_lookahead_slots,
                        preemption_mode=preemption_mode),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        KVCacheInfo(num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_size=block_size),
        speculative=spec if spec is not None else ngram_spec(),
    )


def oracle_drafts(k: int, token_fn=next_token, wrong_rate: float = 0.3) -> Callable[[str, list[int]], list[int]]:
    """Drafts = the model's next k tokens, except that a draft at a position drawn wrong (a fixed
    pseudo-random choice per position, with probability `wrong_rate`) is off by one."""

    def propose(req_id: str, tokens: list[int]) -> list[int]:
        seq, out = list(tokens), []
        for _ in range(k):
            t = token_fn(seq)
            if random.Random(len(seq) * 7919 + len(req_id)).random() < wrong_rate:
                t = (t + 1) % VOCAB
            out.append(t)
            seq.append(t)
        return out

    return propose


class _State:
    def __init__(self, tokens, num_prompt, block_ids, num_computed, params, stop_ids):
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.params = params
        self.stop_ids = set(stop_ids)


def fingerprints(seq: list[int], upto: int) -> list[int]:
    fps, prev = [], 0
    for t in seq[:upto]:
        prev = hash((prev, t))
        fps.append(prev)
    return fps


class SpecFakeRunner:
    """Plays the runner: KV as prefix fingerprints, verification against `token_fn`, drafts from
    `draft_fn(req_id, tokens)`. `produced[req_id]`: every token it returned (before any trimming)."""

    def __init__(self, block_size: int, draft_fn, token_fn=next_token):
        self.block_size = block_size
        self.draft_fn = draft_fn
        self.token_fn = token_fn
        self.kv: dict[tuple[int, int], int] = {}
        self.cpu_kv: dict[tuple[int, int], int] = {}
        self.reqs: dict[str, _State] = {}
        self.produced: dict[str, list[int]] = {}

    def _copy(self, src, sb, dst, db):
        for off in range(self.block_size):
            if (sb, off) in src:
                dst[(db, off)] = src[(sb, off)]
            else:
                dst.pop((db, off), None)

    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        bs = self.block_size
        for req_id in so.finished_req_ids:
            self.reqs.pop(req_id, None)
        for dev, cpu in so.blocks_to_swap_out:
            self._copy(self.kv, dev, self.cpu_kv, cpu)
        for cpu, dev in so.blocks_to_swap_in:
            self._copy(self.cpu_kv, cpu, self.kv, dev)
        for new in so.new_requests:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = _State(list(new.prompt_token_ids) + list(new.output_token_ids),
                                           len(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens,
                                           new.sampling_params, new.stop_token_ids_for_min_tokens)
        for cached in so.cached_requests:
            st = self.reqs[cached.req_id]
            assert st.num_computed == cached.num_computed_tokens, (cached.req_id, st.num_computed,
                                                                   cached.num_computed_tokens)
            st.block_ids.extend(cached.new_block_ids)
        assert set(so.scheduled_spec_token_ids) <= set(so.scheduled_req_ids)
        spans = []
        for req_id, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens):
            st = self.reqs[req_id]
            drafts = so.scheduled_spec_token_ids.get(req_id, [])
            seq = st.tokens + list(drafts)
            start, end = st.num_computed, st.num_computed + n
            if drafts:  # drafts follow the request's last token, which is all it has left to compute
                assert start == len(st.tokens) - 1 and end == len(seq), (req_id, start, n, len(st.tokens), drafts)
            assert n > 0 and end <= len(seq)
            assert len(st.block_ids) * bs >= end and 0 not in st.block_ids
            fps = fingerprints(seq, end)
            for pos in range(start, end):
                self.kv[(st.block_ids[pos // bs], pos % bs)] = fps[pos]
            spans.append((req_id, st, drafts, start, end, fps))
        req_ids, sampled, logprobs, proposed = [], [], [], {}
        for req_id, st, drafts, start, end, fps in spans:
            for pos in range(end):
                assert self.kv.get((st.block_ids[pos // bs], pos % bs)) == fps[pos], f"{req_id}: bad KV at {pos}"
            st.num_computed = end
            if end < len(st.tokens) + len(drafts):
                continue
            out: list[int] = []
            for j in range(len(drafts) + 1):
                t = self.token_fn(st.tokens + out)
                out.append(t)
                if j == len(drafts) or t != drafts[j] or t in st.stop_ids:
                    break
            st.num_computed -= len(drafts) + 1 - len(out)
            st.tokens.extend(out)
            self.produced.setdefault(req_id, []).extend(out)
            req_ids.append(req_id)
            sampled.append(out)
            logprobs.append([TokenLogprobs([t], [-0.5], [1]) for t in out] if st.params.logprobs is not None else [])
            if so.propose_drafts:
                d = self.draft_fn(req_id, st.tokens)
                if d:
                    proposed[req_id] = d
        return RunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs, draft_token_ids=proposed)


class SpecDriver:
    def __init__(self, scheduler: Scheduler, runner: SpecFakeRunner):
        self.scheduler = scheduler
        self.runner = runner
        self.tokens: dict[str, list[int]] = {}
        self.logprobs: dict[str, int] = {}
        self.finish_reasons: dict[str, str] = {}
        self.steps: list[SchedulerOutput] = []
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    def step(self):
        running_before = len(self.scheduler.running)
        so = self.scheduler.schedule()
        self.steps.append(so)
        if self.on_schedule is not None:
            self.on_schedule(so, running_before)
        ro = self.runner.execute(so)
        outs = self.scheduler.update(so, ro)
        for out in outs:
            self.tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            self.logprobs[out.req_id] = self.logprobs.get(out.req_id, 0) + len(out.new_logprobs)
            if out.finish_reason is not None:
                self.finish_reasons[out.req_id] = out.finish_reason
        # Invariant: a decoding request has every token but its last computed (rejected drafts rolled back).
        for req in self.scheduler.running:
            if req.num_output_tokens and req.num_computed_tokens:
                assert req.num_computed_tokens == req.num_tokens - 1, (req.request_id, req.num_computed_tokens,
                                                                       req.num_tokens)
        return so, outs

    def run(self, max_steps: int = 500):
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("not finished")


def driver(scheduler: Scheduler, k: int = 3, wrong_rate: float = 0.3) -> SpecDriver:
    return SpecDriver(scheduler, SpecFakeRunner(scheduler.block_size, oracle_drafts(k, wrong_rate=wrong_rate)))


# -- what a step schedules ------------------------------------------------------------------------------
def test_drafts_follow_the_last_token():
    s = make_spec_scheduler()
    s.add_request(make_request("a", 10, max_tokens=20))
    d = driver(s, wrong_rate=0.0)
    so, _ = d.step()  # the prompt
    assert so.propose_drafts and so.scheduled_spec_token_ids == {} and so.num_scheduled_tokens == [10]
    drafts = s.get_request("a").spec_token_ids
    assert len(drafts) == 3
    so, outs = d.step()
    assert so.scheduled_spec_token_ids == {"a": drafts}
    assert so.num_scheduled_tokens == [1 + 3]
    assert outs[0].new_token_ids[:3] == drafts and len(outs[0].new_token_ids) == 4  # all accepted + 1


def test_outputs_equal_the_reference_with_rejections_and_a_mixed_batch():
    s = make_spec_scheduler(max_num_batched_tokens=16)  # chunked prompts alongside verifying requests
    prompts = {f"r{i}": make_request(f"r{i}", n, max_tokens=m).prompt_token_ids
               for i, (n, m) in enumerate([(5, 12), (23, 9), (9, 17), (14, 4)])}
    for i, (rid, p) in enumerate(prompts.items()):
        s.add_request(make_request(rid, p, max_tokens=[12, 9, 17, 4][i]))
    d = driver(s, k=4, wrong_rate=0.3)
    d.run()
    for i, (rid, p) in enumerate(prompts.items()):
        assert d.tokens[rid] == reference_outputs(p, [12, 9, 17, 4][i], 64), rid
        assert d.finish_reasons[rid] == "length"
    num_spec = sum(len(x) for so in d.steps for x in so.scheduled_spec_token_ids.values())
    assert num_spec > 0 and s.kv_cache_manager.num_used_blocks == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 7])
def test_drafts_never_run_past_max_tokens(max_tokens):
    s = make_spec_scheduler(ngram_spec(k=4))
    s.add_request(req := make_request("a", 6, max_tokens=max_tokens))
    d = driver(s, k=4, wrong_rate=0.0)

    def check(so, _):
        drafts = so.scheduled_spec_token_ids.get("a", [])
        assert len(drafts) <= max_tokens - req.num_output_tokens - 1

    d.on_schedule = check
    d.run()
    assert d.tokens["a"] == reference_outputs(req.prompt_token_ids, max_tokens, 64)
    assert d.finish_reasons["a"] == "length"
    assert len(d.runner.produced["a"]) == max_tokens  # the runner never made a token past max_tokens


def test_drafts_trimmed_by_max_model_len():
    s = make_spec_scheduler(ngram_spec(k=4), max_model_len=20)
    s.add_request(req := make_request("a", 15, max_tokens=100))
    d = driver(s, k=4, wrong_rate=0.0)
    seen = []

    def check(so, _):
        drafts = so.scheduled_spec_token_ids.get("a", [])
        assert len(drafts) <= 20 - req.num_tokens
        seen.append(len(drafts))

    d.on_schedule = check
    d.run()
    assert d.tokens["a"] == reference_outputs(req.prompt_token_ids, 100, 20)
    assert len(d.tokens["a"]) == 5 and d.finish_reasons["a"] == "length"
    assert max(seen) > 0
    # Every draft position is below max_model_len; the bonus token after a draft at position
    # max_model_len - 1 is dropped by the scheduler (it is why produced may exceed the outputs by one).
    assert len(d.runner.produced["a"]) <= 5 + 1


def test_drafts_trimmed_by_the_speculative_max_model_len():
    s = make_spec_scheduler(ngram_spec(k=4, max_model_len=18), max_model_len=30)
    s.add_request(req := make_request("a", 12, max_tokens=14))
    d = driver(s, k=4, wrong_rate=0.0)
    seen = []

    def check(so, _):
        drafts = so.scheduled_spec_token_ids.get("a", [])
        assert len(drafts) <= max(18 - req.num_tokens, 0)
        seen.append((req.num_tokens, len(drafts)))

    d.on_schedule = check
    d.run()
    assert d.tokens["a"] == reference_outputs(req.prompt_token_ids, 14, 30)
    assert any(n > 0 for _, n in seen)
    assert all(n == 0 for tokens, n in seen if tokens >= 18)  # past the cap: plain decoding


def test_disable_by_batch_size():
    s = make_spec_scheduler(ngram_spec(disable_by_batch_size=1))
    s.add_request(make_request("short", 6, max_tokens=3))
    s.add_request(make_request("long", 7, max_tokens=15))
    d = driver(s, wrong_rate=0.0)
    checked = []

    def check(so, running_before):
        if running_before > 1:
            assert so.scheduled_spec_token_ids == {}
        assert so.propose_drafts == (len(s.running) <= 1)
        checked.append((running_before, bool(so.scheduled_spec_token_ids)))

    d.on_schedule = check
    d.run()
    assert (2, False) in checked and (1, True) in checked  # off with two running, on once one is left
    assert d.tokens["long"] == reference_outputs(make_request("x", 7).prompt_token_ids, 15, 64)


def test_disable_logprobs_skips_requests_that_ask_for_logprobs():
    s = make_spec_scheduler(ngram_spec(disable_logprobs=True))
    s.add_request(make_request("lp", 6, max_tokens=8, logprobs=1))
    s.add_request(make_request("plain", 6, max_tokens=8))
    d = driver(s, wrong_rate=0.0)
    d.run()
    assert all("lp" not in so.scheduled_spec_token_ids for so in d.steps)
    assert any("plain" in so.scheduled_spec_token_ids for so in d.steps)
    assert d.logprobs["lp"] == len(d.tokens["lp"]) == 8


# -- after the step ------------------------------------------------------------------------------------
def _prefilled(s: Scheduler, drafts: list[int], prompt_len: int = 8, **params):
    """A request past its prompt, holding `drafts` for the next step."""
    s.add_request(req := make_request("a", prompt_len, max_tokens=20, **params))
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[[]],
                              draft_token_ids={"a": drafts}))
    return req


def test_rejected_drafts_roll_back_num_computed_tokens():
    s = make_spec_scheduler()
    req = _prefilled(s, [6, 7, 8])
    so = s.schedule()
    assert so.scheduled_spec_token_ids == {"a": [6, 7, 8]} and so.num_scheduled_tokens == [4]
    assert req.num_computed_tokens == 12  # 8 prompt + last token + 3 drafts, as if all were accepted
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[6, 9]], logprobs=[[]]))
    assert req.output_token_ids == [5, 6, 9]
    assert req.num_computed_tokens == 10 == req.num_tokens - 1  # drafts 7 and 8 were rejected
    assert req.spec_token_ids == []  # the runner proposed nothing this time
    so = s.schedule()
    assert so.cached_requests[0].num_computed_tokens == 10 and so.num_scheduled_tokens == [1]


def test_tokens_after_a_stop_token_are_dropped():
    eos = 3
    s = make_spec_scheduler()
    s.add_request(make_request("a", 8, max_tokens=20, eos=(eos,), logprobs=0))
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[[TokenLogprobs([5], [-1.0], [1])]],
                              draft_token_ids={"a": [6, eos, 8]}))
    so = s.schedule()
    assert so.scheduled_spec_token_ids == {"a": [6, eos, 8]}
    lps = [TokenLogprobs([t], [-1.0], [1]) for t in (6, eos, 9)]
    outs = s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[6, eos, 9]], logprobs=[lps],
                                     draft_token_ids={"a": [1, 2]}))
    assert outs[0].new_token_ids == [6, eos] and len(outs[0].new_logprobs) == 2
    assert outs[0].finish_reason == "stop"
    assert s.get_request("a") is None and not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_used_blocks == 0


def test_stop_token_ids_mid_step_and_ignore_eos():
    s = make_spec_scheduler()
    _prefilled(s, [6, 7, 8], stop_token_ids=[7])
    so = s.schedule()
    outs = s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[6, 7, 8, 9]], logprobs=[[]]))
    assert outs[0].new_token_ids == [6, 7] and outs[0].finish_reason == "stop" and outs[0].stop_reason == 7

    s = make_spec_scheduler()
    s.add_request(make_request("a", 8, max_tokens=20, eos=(7,), ignore_eos=True))
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[[]], draft_token_ids={"a": [6, 7, 8]}))
    so = s.schedule()
    outs = s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[6, 7, 8, 9]], logprobs=[[]]))
    assert outs[0].new_token_ids == [6, 7, 8, 9] and outs[0].finish_reason is None


def test_max_tokens_mid_step_keeps_exactly_max_tokens():
    """Even if a runner returned more tokens than allowed, the output stops at max_tokens."""
    s = make_spec_scheduler()
    s.add_request(make_request("a", 8, max_tokens=3))
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[[]], draft_token_ids={"a": [6, 7, 8]}))
    so = s.schedule()
    assert so.scheduled_spec_token_ids == {"a": [6]}  # max_tokens 3 - 1 output - 1 bonus
    outs = s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[6, 7, 9]], logprobs=[[]]))
    assert outs[0].new_token_ids == [6, 7] and outs[0].finish_reason == "length"


def test_preemption_clears_drafts():
    s = make_spec_scheduler(ngram_spec(k=4), num_blocks=12, block_size=4, max_num_batched_tokens=64)
    prompts = {}
    for i in range(3):
        prompts[f"r{i}"] = make_request(f"r{i}", 8 + i, max_tokens=14).prompt_token_ids
        s.add_request(make_request(f"r{i}", prompts[f"r{i}"], max_tokens=14))
    d = driver(s, k=4, wrong_rate=0.3)
    preempted = []

    def check(so, _):
        for rid in so.finished_req_ids:
            req = s.get_request(rid)
            if req is not None:  # preempted, not finished
                preempted.append(rid)
                assert req.spec_token_ids == []
                assert rid not in so.scheduled_spec_token_ids

    d.on_schedule = check
    d.run()
    assert preempted and s.num_preemptions > 0
    for rid, p in prompts.items():
        assert d.tokens[rid] == reference_outputs(p, 14, 64), rid


def test_swap_preemption_with_drafts_keeps_outputs():
    s = make_spec_scheduler(ngram_spec(k=4), num_blocks=12, block_size=4, preemption_mode="swap", num_cpu_blocks=32)
    prompts = {f"r{i}": make_request(f"r{i}", 8 + i).prompt_token_ids for i in range(3)}
    for rid, p in prompts.items():
        s.add_request(make_request(rid, p, max_tokens=14))
    d = driver(s, k=4, wrong_rate=0.3)
    d.run()
    assert s.num_preemptions > 0
    for rid, p in prompts.items():
        assert d.tokens[rid] == reference_outputs(p, 14, 64), rid


@pytest.mark.parametrize("lookahead", [0, 4])
def test_lookahead_slots_allocate_extra_blocks(lookahead):
    s = make_spec_scheduler(num_lookahead_slots=lookahead, block_size=4)
    s.add_request(make_request("a", 8, max_tokens=10))
    so = s.schedule()
    assert len(so.new_requests[0].block_ids) == (12 if lookahead else 8) // 4
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[[]]))
    s.schedule()  # decode of position 8: needs 9 (+ lookahead) slots
    assert len(s.kv_cache_manager.get_block_ids("a")) == -(-(9 + lookahead) // 4)


# -- stats ----------------------------------------------------------------------------------------------
def test_spec_decoding_stats():
    s = make_spec_scheduler(ngram_spec(k=3))
    assert s.make_stats().spec_decoding.num_drafts == 0
    _prefilled(s, [6, 7, 8])
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[6, 9]], logprobs=[[]],
                              draft_token_ids={"a": [1, 2, 3]}))  # 1 of 3 accepted
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[1, 2, 3, 4]], logprobs=[[]],
                              draft_token_ids={"a": [5, 6]}))  # 3 of 3
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[0]], logprobs=[[]]))  # 0 of 2
    peek = s.make_stats(consume=False)
    assert peek.spec_decoding is None  # a peek leaves the counters alone
    stats = s.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos[:3] == [2, 1, 1]
    again = s.make_stats().spec_decoding
    assert (again.num_drafts, again.num_draft_tokens, again.num_accepted_tokens) == (0, 0, 0)


def test_no_spec_stats_without_speculation():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64), CacheConfig(),
                  KVCacheInfo(num_blocks=64, num_cpu_blocks=0, block_size=4))
    s.add_request(make_request("a", 8))
    so = s.schedule()
    assert so.propose_drafts is False
    assert s.make_stats().spec_decoding is None


def test_driver_stats_add_up():
    s = make_spec_scheduler(ngram_spec(k=4))
    s.add_request(make_request("a", 9, max_tokens=30))
    d = driver(s, k=4, wrong_rate=0.3)
    d.run()
    stats = s.make_stats().spec_decoding
    verified = [len(so.scheduled_spec_token_ids["a"]) for so in d.steps if "a" in so.scheduled_spec_token_ids]
    assert stats.num_drafts == len(verified) and stats.num_draft_tokens == sum(verified)
    # every output token past the first of each step came from an accepted draft
    assert stats.num_accepted_tokens == 30 - len([so for so in d.steps if "a" in so.scheduled_req_ids])
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


# -- prefix caching ---------------------------------------------------------------------------------
def test_prefix_cache_holds_only_accepted_tokens():
    """A request verifies drafts that are often wrong; afterwards a request whose prompt is its whole
    sequence hits exactly the blocks full of tokens known when they were scheduled (accepted ones; the
    fake runner checks each hit block holds the right KV), and one whose prompt continues with a
    rejected draft stops hitting at that draft's block."""
    bs = 4
    s = make_spec_scheduler(ngram_spec(k=4), block_size=bs, max_model_len=64)
    first = make_request("a", 6, max_tokens=17)
    s.add_request(first)
    d = driver(s, k=4, wrong_rate=0.3)
    scheduled: list[tuple[int, list[int]]] = []  # (num_tokens when scheduled, drafts)

    def record(so, _):
        if "a" in so.scheduled_req_ids:
            scheduled.append((first.num_tokens, list(so.scheduled_spec_token_ids.get("a", []))))

    d.on_schedule = record
    d.run()
    seq = first.prompt_token_ids + d.tokens["a"]
    assert len(seq) == 23
    rejected = [(pos, dr) for pos, dr in scheduled if dr and dr[0] != seq[pos]]
    assert rejected, "the oracle's wrong drafts were never the first draft: nothing tested"
    num_registered = scheduled[-1][0] // bs  # blocks full of tokens known at the last schedule

    hits_before = s.kv_cache_manager.prefix_cache_hits
    s.add_request(make_request("b", seq + [1], max_tokens=1))
    d.on_schedule = None
    so = s.schedule()
    hit = s.kv_cache_manager.prefix_cache_hits - hits_before
    assert hit == min(num_registered, len(seq) // bs) * bs == s.get_request("b").num_cached_tokens
    assert hit >= 16
    s.update(so, d.runner.execute(so))  # reads every hit position: each must hold the right prefix

    pos, drafts = next((p, dr) for p, dr in reversed(rejected) if p >= 2 * bs)
    hits_before = s.kv_cache_manager.prefix_cache_hits
    s.add_request(make_request("c", seq[:pos] + drafts + [1, 2, 3, 4, 5], max_tokens=1))
    so = s.schedule()
    assert s.kv_cache_manager.prefix_cache_hits - hits_before == (pos // bs) * bs
    s.update(so, d.runner.execute(so))


def test_an_accepted_draft_that_ends_the_request_counts_as_accepted():
    """Verification stops at an accepted EOS draft: it is the step's last token and an accepted draft."""
    s = make_spec_scheduler(ngram_spec(k=3))
    s.add_request(make_request("a", 8, max_tokens=20, eos=(2,)))
    so = s.schedule()
    s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], logprobs=[[]], draft_token_ids={"a": [7, 2, 9]}))
    so = s.schedule()
    outs = s.update(so, RunnerOutput(req_ids=["a"], sampled_token_ids=[[7, 2]], logprobs=[[]]))
    assert outs[0].new_token_ids == [7, 2] and outs[0].finish_reason == "stop"
    stats = s.make_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
