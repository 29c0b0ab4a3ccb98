from collections import Counter

import pytest

from aserve.core.batch import RunnerOutput, TokenLogprobs
from aserve.core.request import RequestStatus
from tests.core.core_fakes import (
    Driver,
    FakeRunner,
    make_request,
    make_scheduler,
    next_token,
    reference_outputs,
)


# -- budget, seqs, chunking, ordering ---------------------------------------------------------------

def test_budget_and_max_num_seqs_are_respected():
    s = make_scheduler(max_num_batched_tokens=20, max_num_seqs=3, num_blocks=200)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 9 + i, max_tokens=5))
    d = Driver(s)
    while s.has_unfinished_requests():
        so, _ = d.step()
        assert so.total_num_scheduled_tokens <= 20
        assert len(so.scheduled_req_ids) <= 3 and len(s.running) <= 3
    for i in range(6):
        assert d.tokens[f"r{i}"] == reference_outputs(make_request("x", 9 + i).prompt_token_ids, 5, 64)


def test_chunked_prefill_splits_a_long_prompt():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=128, num_blocks=64)
    s.add_request(make_request("long", 50, max_tokens=2))
    d = Driver(s)
    chunks = []
    for _ in range(5):
        so, _ = d.step()
        chunks.append(so.num_scheduled_tokens[0])
    assert chunks == [16, 16, 16, 2, 1]
    assert len(d.tokens["long"]) == 2 and d.finish_reasons["long"] == "length"


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget_fcfs_stops_scanning():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False,
                       enable_prefix_caching=False)
    for rid, n in (("a", 10), ("b", 10), ("c", 3)):
        s.add_request(make_request(rid, n, max_tokens=3))
    so = s.schedule()
    assert so.scheduled_req_ids == ["a"]  # b does not fit in the 6 left; c waits behind it
    assert so.num_scheduled_tokens == [10]


def test_without_chunked_prefill_priority_policy_skips_a_prompt_that_does_not_fit():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False, policy="priority",
                       enable_prefix_caching=False)
    for rid, n, prio in (("a", 10, 0), ("b", 10, 1), ("c", 3, 2)):
        s.add_request(make_request(rid, n, max_tokens=3, priority=prio))
    so = s.schedule()
    assert so.scheduled_req_ids == ["a", "c"]
    assert [r.request_id for r in s.waiting] == ["b"]


def test_decodes_are_scheduled_before_prefills():
    s = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    d = Driver(s)
    s.add_request(make_request("a", 5, max_tokens=10))
    d.step()
    s.add_request(make_request("b", 20, max_tokens=2))
    so, _ = d.step()
    assert so.scheduled_req_ids == ["a", "b"] and so.num_scheduled_tokens == [1, 7]
    assert [c.req_id for c in so.cached_requests] == ["a"] and [n.req_id for n in so.new_requests] == ["b"]


def test_cached_requests_carry_only_new_blocks():
    s = make_scheduler(block_size=4)
    d = Driver(s)
    s.add_request(make_request("a", 4, max_tokens=6))
    so, _ = d.step()
    assert len(so.new_requests[0].block_ids) == 1
    so, _ = d.step()  # token 4 needs a second block
    assert len(so.cached_requests[0].new_block_ids) == 1 and so.cached_requests[0].num_computed_tokens == 4
    so, _ = d.step()
    assert so.cached_requests[0].new_block_ids == [] and so.cached_requests[0].num_computed_tokens == 5


def test_new_request_data_stop_ids_for_min_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", 3, eos=(2, 3), stop_token_ids=[7], min_tokens=1))
    s.add_request(make_request("b", 3, eos=(2,), stop_token_ids=[7], ignore_eos=True))
    so = s.schedule()
    assert [n.stop_token_ids_for_min_tokens for n in so.new_requests] == [[7, 2, 3], [7]]


# -- preemption -----------------------------------------------------------------------------------

def test_recompute_preemption_resumes_with_all_tokens():
    # 7 usable blocks of 4: two requests growing to 4 blocks each cannot both fit.
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=64, enable_prefix_caching=False)
    prompts = {"a": 8, "b": 8}
    for rid, n in prompts.items():
        s.add_request(make_request(rid, n, max_tokens=8))
    d = Driver(s)
    preempted_seen = False
    while s.has_unfinished_requests():
        so, _ = d.step()
        if "b" in so.finished_req_ids and "b" in s.requests:
            preempted_seen = True
            assert s.get_request("b").status == RequestStatus.PREEMPTED
            assert s.get_request("b").num_computed_tokens == 0 and s.kv_cache_manager.get_block_ids("b") == []
            num_out = s.get_request("b").num_output_tokens
            assert num_out > 0
            # once resumed, its prompt + outputs so far go out as a new request, computed from scratch
            resumed = None
            for _ in range(50):
                so2, _ = d.step()
                resumed = next((n for n in so2.new_requests if n.req_id == "b"), None)
                if resumed is not None:
                    break
            assert resumed is not None, "the preempted request was never resumed"
            assert len(resumed.output_token_ids) == num_out and resumed.num_computed_tokens == 0
            assert resumed.prompt_token_ids == make_request("x", prompts["b"]).prompt_token_ids
    assert preempted_seen
    assert s.make_stats().num_preemptions >= 1
    for rid, n in prompts.items():
        assert d.tokens[rid] == reference_outputs(make_request("x", n).prompt_token_ids, 8, 64)
    assert s.kv_cache_manager.num_free_blocks == 7


def test_recompute_after_preemption_hits_the_prefix_cache():
    s = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=True)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, [1 if rid == "a" else 2] * 8, max_tokens=8))
    d = Driver(s)
    resumed_cached = []
    while s.has_unfinished_requests():
        so, _ = d.step()
        resumed_cached += [n.num_computed_tokens for n in so.new_requests if n.output_token_ids]
    assert resumed_cached and max(resumed_cached) > 0
    assert d.tokens["b"] == reference_outputs([2] * 8, 8, 64)


def test_victim_is_the_request_itself_when_it_is_last():
    s = make_scheduler(num_blocks=3, block_size=4, max_model_len=16, enable_prefix_caching=False)
    s.add_request(make_request("a", 4, max_tokens=5))
    s.add_request(make_request("b", 4, max_tokens=5))
    d = Driver(s)
    d.step()  # both prefilled: 2 blocks used
    so, _ = d.step()  # both need a second block: only a gets one, b preempts itself
    assert so.scheduled_req_ids == ["a"] and "b" in so.finished_req_ids
    assert s.get_request("b").status == RequestStatus.PREEMPTED
    assert [r.request_id for r in s.waiting] == ["b"]


def test_priority_policy_admits_by_priority_then_arrival():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(make_request("late-urgent", 3, priority=0, arrival_time=5.0, max_tokens=1))
    s.add_request(make_request("low", 3, priority=2, arrival_time=0.0, max_tokens=1))
    s.add_request(make_request("early-urgent", 3, priority=0, arrival_time=1.0, max_tokens=1))
    s.add_request(make_request("mid", 3, priority=1, arrival_time=0.0, max_tokens=1))
    d = Driver(s)
    order = []
    while s.has_unfinished_requests():
        so, _ = d.step()
        order += [n.req_id for n in so.new_requests]
    assert order == ["early-urgent", "late-urgent", "mid", "low"]


def test_priority_victim_is_the_lowest_priority_even_if_already_scheduled():
    s = make_scheduler(policy="priority", num_blocks=5, block_size=4, max_model_len=16,
                       enable_prefix_caching=False)
    s.add_request(make_request("low", 3, priority=5, max_tokens=5))
    d = Driver(s)
    d.step()
    s.add_request(make_request("high", 4, priority=0, max_tokens=5, arrival_time=1.0))
    s.add_request(make_request("mid", 2, priority=1, max_tokens=5, arrival_time=1.0))
    d.step()  # running: low, high, mid; 3 of 4 blocks used
    assert [r.request_id for r in s.running] == ["low", "high", "mid"]
    so, _ = d.step()  # low takes the last block, high needs one: low (already scheduled) is undone
    assert so.scheduled_req_ids == ["high", "mid"] and so.num_scheduled_tokens == [1, 1]
    assert "low" in so.finished_req_ids and s.get_request("low").status == RequestStatus.PREEMPTED
    assert so.total_num_scheduled_tokens == 2
    d.run()
    assert d.tokens["low"] == reference_outputs(make_request("x", 3).prompt_token_ids, 5, 16)


def _record_victims(s):
    """Wraps `s._victim_index`; returns a list that gets, per preemption, (victim, running at that moment)."""
    victims = []
    choose = s._victim_index

    def recording_victim_index():
        idx = choose()
        victims.append((s.running[idx], list(s.running)))
        return idx

    s._victim_index = recording_victim_index
    return victims


def _flood_then_one(s, *, client_a, client_b, max_tokens=10):
    """Key A's three requests are admitted in the first step, key B's one in the second (last in running).
    Each prompt fills one block of 4; each request's first decode needs a second block."""
    for i in range(3):
        s.add_request(make_request(f"a{i}", 4, max_tokens=max_tokens, client_id=client_a))
    d = Driver(s)
    d.step()
    s.add_request(make_request("b0", 4, max_tokens=max_tokens, client_id=client_b))
    return d


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_from_the_client_with_the_most_running_requests(mode):
    # 7 usable blocks: four requests at 1 block each, then growing by decode to 2-3 blocks each.
    s = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False, preemption_mode=mode,
                       num_cpu_blocks=16 if mode == "swap" else 0)
    victims = _record_victims(s)
    d = _flood_then_one(s, client_a="key-a", client_b="key-b")
    saw_swap_out = False
    while s.has_unfinished_requests():
        so, _ = d.step()
        saw_swap_out |= bool(so.blocks_to_swap_out)
    assert victims, "the KV cache was never short"
    assert [v.request_id for v, _ in victims] == ["a2", "a1"]
    assert saw_swap_out == (mode == "swap")
    for victim, running in victims:
        num_running = Counter(r.client_id for r in running)
        assert victim.client_id == "key-a" and num_running["key-a"] > num_running["key-b"]
        assert victim is [r for r in running if r.client_id == "key-a"][-1]  # A's latest admitted
        assert running[-1].request_id == "b0"  # the old rule (last running) would have taken B's
    assert s.get_request("b0") is None and d.tokens["b0"] == reference_outputs(
        make_request("x", 4).prompt_token_ids, 10, 64)
    assert all(d.tokens[rid] == d.tokens["b0"] for rid in ("a0", "a1", "a2"))


@pytest.mark.parametrize("client", [None, "key-a"])
def test_with_a_single_client_the_victim_is_the_last_running_request(client):
    s = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=False)
    victims = _record_victims(s)
    d = _flood_then_one(s, client_a=client, client_b=client)
    so, _ = d.step()  # b0 admitted: all 7 blocks used
    so, _ = d.step()  # b0's first decode needs a block: it is last, so it preempts itself
    assert "b0" not in so.scheduled_req_ids and s.get_request("b0").status == RequestStatus.PREEMPTED
    d.run()
    assert victims and all(victim is running[-1] for victim, running in victims)
    assert victims[0][0].request_id == "b0"


def test_fcfs_victim_ties_between_clients_go_to_the_latest_running_request():
    s = make_scheduler()

    def victim_of(*ids):
        s.running = [make_request(rid, 4, client_id=rid[0]) for rid in ids]
        return s.running[s._victim_index()].request_id

    assert victim_of("a0", "a1", "b0") == "a1"  # a holds the most
    assert victim_of("a0", "b0", "a1", "b1") == "b1"  # 2 each: b owns the latest
    assert victim_of("a0", "b0", "b1", "a1") == "a1"
    assert victim_of("b0", "a0", "a1", "a2", "b1") == "a2"


# -- abort / finish -----------------------------------------------------------------------------

def test_abort_frees_blocks_now_and_is_reported_once():
    s = make_scheduler(num_blocks=10)
    d = Driver(s)
    s.add_request(make_request("a", 8, max_tokens=10))
    s.add_request(make_request("w", 8, max_tokens=10))
    so = s.schedule()
    used = s.kv_cache_manager.num_used_blocks
    s.abort_requests(["a", "unknown"])
    assert s.kv_cache_manager.num_used_blocks < used
    assert s.get_request("a") is None
    # The step in flight still returns a token for "a": it is ignored.
    ro = d.runner.execute(so)
    outs = s.update(so, ro)
    assert [o.req_id for o in outs] == ["w"]
    so = s.schedule()
    assert so.finished_req_ids == ["a"] and "a" not in so.scheduled_req_ids
    assert s.schedule().finished_req_ids == []
    s.abort_requests("w")  # also a single id; a waiting/running request
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_used_blocks == 0


def test_abort_a_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    s.schedule()
    s.abort_requests(["b"])
    assert len(s.waiting) == 0 and list(s.requests) == ["a"]
    assert s.schedule().finished_req_ids == ["b"]


def test_finish_requests_with_a_status():
    s = make_scheduler()
    d = Driver(s)
    s.add_request(make_request("a", 4, max_tokens=10))
    d.step()
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # e.g. a stop string matched
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == ["a"]
    with pytest.raises(ValueError, match="status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(make_request("a", 4))


def test_a_request_failed_by_the_runner_fails_alone_and_its_blocks_are_forgotten():
    s = make_scheduler(enable_prefix_caching=True)
    s.add_request(make_request("a", 9))
    s.add_request(make_request("c", [40, 41, 42, 43, 44]))
    so = s.schedule()
    outs = s.update(so, RunnerOutput(["c"], [[7]], [[]], failed_requests={"a": "logits processor raised"}))
    assert [(o.req_id, o.finish_reason, o.error) for o in outs] == [
        ("a", "error", "logits processor raised"), ("c", None, None)]
    assert s.get_request("a") is None and s.get_request("c").output_token_ids == [7]
    assert s.schedule().finished_req_ids == ["a"]
    s.abort_requests(["c"])
    assert not s.has_unfinished_requests() and s.kv_cache_manager.num_used_blocks == 0
    s.add_request(make_request("b", 9))
    s.schedule()
    assert s.get_request("b").num_cached_tokens == 0


# -- prefix sharing and n > 1 ---------------------------------------------------------------------

def test_prefix_hits_are_counted_and_blocks_shared():
    s = make_scheduler(block_size=4, enable_prefix_caching=True)
    d = Driver(s)
    s.add_request(make_request("a", 10, max_tokens=20))
    d.step()
    s.add_request(make_request("b", 10, max_tokens=3))
    so, outs = d.step()
    assert so.new_requests[0].num_computed_tokens == 8 and so.num_scheduled_tokens == [1, 2]
    assert s.get_request("b").num_cached_tokens == 8
    assert [o.num_cached_tokens for o in outs if o.req_id == "b"] == [8]
    kv = s.kv_cache_manager
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared and [kv.pool.ref_cnt(b) for b in shared] == [2, 2]
    snap = s.make_stats()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (20, 8)
    d.run()
    assert d.tokens["b"] == reference_outputs(make_request("x", 10).prompt_token_ids, 3, 64)


@pytest.mark.parametrize("caching", [False, True])
def test_n_siblings_wait_for_the_leader_then_share_its_prompt_blocks(caching):
    s = make_scheduler(block_size=4, enable_prefix_caching=caching, max_num_batched_tokens=64)
    d = Driver(s)
    prompt = make_request("x", 13).prompt_token_ids
    s.add_request(make_request("s1", prompt, wait_for_req_id="l", share_prefix=True, max_tokens=3))
    s.add_request(make_request("l", prompt, share_prefix=True, max_tokens=3))
    s.add_request(make_request("s2", prompt, wait_for_req_id="l", share_prefix=True, max_tokens=3))
    s.add_request(make_request("other", [40] * 5, max_tokens=3))
    so, _ = d.step()
    assert so.scheduled_req_ids == ["l", "other"]  # siblings skipped, not blocking "other"
    assert [r.request_id for r in s.waiting] == ["s1", "s2"]
    so, _ = d.step()
    new = {n.req_id: n for n in so.new_requests}
    assert set(new) == {"s1", "s2"} and new["s1"].num_computed_tokens == 12
    kv = s.kv_cache_manager
    lead_blocks = kv.get_block_ids("l")[:3]
    assert [kv.pool.ref_cnt(b) for b in lead_blocks] == [3, 3, 3]
    assert kv.get_block_ids("s1")[:3] == lead_blocks == kv.get_block_ids("s2")[:3]
    d.run()
    assert d.tokens["s1"] == d.tokens["s2"] == d.tokens["l"] == reference_outputs(prompt, 3, 64)
    assert kv.num_used_blocks == 0


def test_sibling_waits_while_leader_prefill_is_chunked():
    s = make_scheduler(block_size=4, enable_prefix_caching=False, max_num_batched_tokens=8)
    d = Driver(s)
    prompt = make_request("x", 20).prompt_token_ids
    s.add_request(make_request("l", prompt, share_prefix=True, max_tokens=2))
    s.add_request(make_request("s", prompt, wait_for_req_id="l", share_prefix=True, max_tokens=2))
    admitted = False
    while not admitted:
        leader_computed = s.get_request("l").num_computed_tokens
        so, _ = d.step()
        admitted = "s" in [n.req_id for n in so.new_requests]
    assert leader_computed >= 20  # the leader's whole prompt was computed before the sibling started
    assert s.get_request("s").num_cached_tokens == 16


# -- swap -----------------------------------------------------------------------------------------

def test_swap_out_and_back_in_round_trip():
    s = make_scheduler(num_blocks=8, block_size=4, preemption_mode="swap", num_cpu_blocks=8,
                       enable_prefix_caching=False)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 8, max_tokens=8))
    d = Driver(s)
    saw_out = saw_in = False
    while s.has_unfinished_requests():
        so, _ = d.step()
        if so.blocks_to_swap_out:
            saw_out = True
            assert "b" in so.finished_req_ids and s.get_request("b").status == RequestStatus.SWAPPED
            assert s.make_stats().num_swapped_reqs == 1
            assert [c for _, c in so.blocks_to_swap_out] == s.kv_cache_manager.get_cpu_block_ids("b")
            computed = s.get_request("b").num_computed_tokens
        if so.blocks_to_swap_in:
            saw_in = True
            new = {n.req_id: n for n in so.new_requests}
            assert new["b"].num_computed_tokens == computed
            assert new["b"].block_ids == [dv for _, dv in so.blocks_to_swap_in] + \
                (new["b"].block_ids[len(so.blocks_to_swap_in):])
    assert saw_out and saw_in
    ref = reference_outputs(make_request("x", 8).prompt_token_ids, 8, 64)
    assert d.tokens["a"] == d.tokens["b"] == ref
    assert s.kv_cache_manager.num_free_cpu_blocks == 8 and s.kv_cache_manager.num_used_blocks == 0


def test_swap_mode_without_cpu_blocks_recomputes():
    s = make_scheduler(num_blocks=8, block_size=4, preemption_mode="swap", num_cpu_blocks=0,
                       enable_prefix_caching=False)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, 8, max_tokens=8))
    d = Driver(s)
    while s.has_unfinished_requests():
        so, _ = d.step()
        assert not so.blocks_to_swap_out and not so.blocks_to_swap_in and len(s.swapped) == 0
    assert s.make_stats().num_preemptions >= 1


# -- stop conditions ------------------------------------------------------------------------------

def run_one(request, script=None, **sched_kwargs):
    s = make_scheduler(**sched_kwargs)
    d = Driver(s, FakeRunner(s.block_size, script={request.request_id: list(script or [])}))
    s.add_request(request)
    d.run()
    rid = request.request_id
    return d.tokens[rid], d.finish_reasons[rid], d.stop_reasons[rid]


def test_stop_on_eos():
    assert run_one(make_request("a", 3, eos=(2,), max_tokens=10), [5, 2, 6]) == ([5, 2], "stop", None)


def test_ignore_eos():
    toks, reason, _ = run_one(make_request("a", 3, eos=(2,), max_tokens=4, ignore_eos=True), [2, 2, 2, 2, 2])
    assert (toks, reason) == ([2, 2, 2, 2], "length")


def test_stop_token_ids_report_the_token():
    assert run_one(make_request("a", 3, stop_token_ids=[9], max_tokens=10), [5, 9]) == ([5, 9], "stop", 9)


def test_min_tokens_defers_stops():
    req = make_request("a", 3, eos=(2,), stop_token_ids=[9], min_tokens=3, max_tokens=10)
    assert run_one(req, [2, 9, 2, 1]) == ([2, 9, 2], "stop", None)


def test_max_tokens():
    toks, reason, _ = run_one(make_request("a", 3, max_tokens=4), [1] * 10)
    assert (toks, reason) == ([1, 1, 1, 1], "length")


def test_max_model_len_caps_generation():
    toks, reason, _ = run_one(make_request("a", 10, max_tokens=100), [1] * 100, max_model_len=13)
    assert (len(toks), reason) == (3, "length")


def test_max_tokens_none_resolves_from_max_model_len():
    toks, reason, _ = run_one(make_request("a", 10, max_tokens=None, max_model_len=13), [1] * 100,
                              max_model_len=13)
    assert (len(toks), reason) == (3, "length")


# -- logprobs and stats ---------------------------------------------------------------------------

def test_logprobs_and_chunked_prompt_logprobs_pass_through():
    s = make_scheduler(max_num_batched_tokens=6, enable_prefix_caching=True)
    d = Driver(s)
    s.add_request(make_request("a", 10, max_tokens=2, logprobs=1, prompt_logprobs=1))
    d.run()
    outs = [o for o in d.outputs if o.req_id == "a"]
    prompt_positions = [lp.ranks[0] for o in outs for lp in (o.new_prompt_logprobs or [])]
    assert prompt_positions == list(range(1, 10))
    assert outs[0].new_token_ids == [] and outs[0].new_prompt_logprobs  # first chunk: no token yet
    token_outs = [o for o in outs if o.new_token_ids]
    assert len(token_outs) == 2
    assert all(len(o.new_logprobs) == 1 and o.new_logprobs[0].token_ids == o.new_token_ids for o in token_outs)


def test_make_stats_reports_gauges_now():
    s = make_scheduler(num_blocks=11, block_size=4, max_num_seqs=1)
    s.add_request(make_request("a", 6, max_tokens=5))
    s.add_request(make_request("b", 6, max_tokens=5))
    d = Driver(s)
    d.step()
    snap = s.make_stats()
    assert (snap.num_running_reqs, snap.num_waiting_reqs, snap.num_swapped_reqs) == (1, 1, 0)
    assert (snap.num_used_blocks, snap.num_total_blocks) == (2, 10)
    assert snap.kv_cache_usage == pytest.approx(0.2)
    assert snap.num_tokens_in_used_blocks == 6


def test_empty_schedule():
    s = make_scheduler()
    so = s.schedule()
    assert so.is_empty and so.finished_req_ids == []
    assert s.update(so, RunnerOutput([], [], [])) == []
    assert next_token([1, 2]) == next_token([1, 2])
    assert TokenLogprobs([1], [0.0], [1]).token_ids == [1]


def test_make_stats_counters_are_per_call_deltas():
    s = make_scheduler(block_size=4, enable_prefix_caching=True)
    d = Driver(s)
    s.add_request(make_request("a", 10, max_tokens=20))
    d.step()
    assert s.make_stats().prefix_cache_queries == 10
    assert s.make_stats().prefix_cache_queries == 0, "a second call reports nothing new"
    s.add_request(make_request("b", 10, max_tokens=3))
    d.step()
    peek = s.make_stats(consume=False)
    stats = s.make_stats()
    assert (peek.prefix_cache_queries, peek.prefix_cache_hits) == (stats.prefix_cache_queries,
                                                                  stats.prefix_cache_hits) == (10, 8)
