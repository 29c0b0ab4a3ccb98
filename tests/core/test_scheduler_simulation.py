"""Random workloads through schedule -> FakeRunner -> update, checking the scheduler's promises.

The fake runner checks the protocol and the KV contents it reads (so prefix sharing, preemption and
swap must hand it the right blocks); here we check budgets, block accounting every step, and that
every request generates exactly what it would alone.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from aserve.core.request import RequestStatus
from tests.core.core_fakes import FakeRunner, make_request, make_scheduler, reference_outputs

PREFIXES = ([], [3, 1, 4, 1], [3, 1, 4, 1, 5, 9, 2, 6])


@st.composite
def scenarios(draw, pressure=False):
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.integers(8, 24))
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else max_model_len, 40))
    min_blocks = -(-max_model_len // block_size) + 1
    config = {
        "block_size": block_size, "max_model_len": max_model_len, "enable_chunked_prefill": chunked,
        "max_num_batched_tokens": budget, "max_num_seqs": draw(st.integers(1, 6)),
        "num_blocks": min_blocks + draw(st.integers(0, 2 if pressure else 6)),
        "enable_prefix_caching": draw(st.booleans()), "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "preemption_mode": draw(st.sampled_from(["swap", "swap", "recompute"] if pressure else ["recompute", "swap"])),
        "num_cpu_blocks": draw(st.integers(4 if pressure else 0, 16)),
    }
    groups = []
    for g in range(draw(st.integers(4 if pressure else 1, 8))):
        prefix = draw(st.sampled_from(PREFIXES))
        tail = draw(st.lists(st.integers(0, 9), max_size=max_model_len))
        prompt = (prefix + tail)[: max_model_len - 1] or [7]
        groups.append({
            "id": f"g{g}", "prompt": prompt, "n": draw(st.integers(1, 3)), "max_tokens": draw(st.integers(1, 10)),
            "eos": draw(st.sampled_from([(), (0,), (5, 11)])), "priority": draw(st.integers(0, 2)),
            "arrive": draw(st.integers(0, 1 if pressure else 6)),
            "abort": draw(st.one_of(st.none(), st.tuples(st.integers(0, 12), st.booleans()))),
        })
    return config, groups


def check_blocks(s):
    kv = s.kv_cache_manager
    pool = kv.pool
    assert kv.num_free_blocks + kv.num_used_blocks == pool.num_blocks - 1
    counts = [0] * pool.num_blocks
    cpu = []
    for rid, req in s.requests.items():
        table = kv.get_block_ids(rid)
        if req.status == RequestStatus.RUNNING:
            assert len(table) * s.block_size >= req.num_computed_tokens
        elif req.status == RequestStatus.SWAPPED:
            assert not table
            cpu += kv.get_cpu_block_ids(rid)
        else:
            assert not table and req.num_computed_tokens == 0
        for b in table:
            counts[b] += 1
    for b in range(1, pool.num_blocks):
        assert pool.ref_cnt(b) == counts[b]
    assert len(cpu) == len(set(cpu)) and len(cpu) + kv.num_free_cpu_blocks == kv.num_cpu_blocks


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_random_workloads(scenario):
    run_scenario(*scenario)


@settings(max_examples=40, deadline=None)
@given(scenarios(pressure=True))
def test_random_workloads_under_memory_pressure_with_swap(scenario):
    run_scenario(*scenario)


def run_scenario(config, groups):
    s = make_scheduler(**config)
    runner = FakeRunner(config["block_size"])
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for step in range(3000):
        for g in groups:
            if g["arrive"] == step:
                ids = [g["id"]] + [f"{g['id']}.{i}" for i in range(1, g["n"])]
                members[g["id"]] = ids
                for i, rid in enumerate(ids):
                    s.add_request(make_request(
                        rid, g["prompt"], max_tokens=g["max_tokens"], eos=g["eos"], priority=g["priority"],
                        arrival_time=float(step), wait_for_req_id=ids[0] if i else None, share_prefix=g["n"] > 1))
        aborts_in_flight = []
        for g in groups:
            if g["abort"] is not None and g["abort"][0] == step and g["id"] in members:
                if g["abort"][1]:
                    aborts_in_flight += members[g["id"]]  # aborted while the step runs
                else:
                    s.abort_requests(members[g["id"]])
        so = s.schedule()
        assert so.total_num_scheduled_tokens <= config["max_num_batched_tokens"]
        assert len(so.scheduled_req_ids) <= config["max_num_seqs"] and len(s.running) <= config["max_num_seqs"]
        for rid, n in zip(so.scheduled_req_ids, so.num_scheduled_tokens):
            req = s.get_request(rid)
            assert req.num_computed_tokens <= req.num_tokens <= config["max_model_len"]
            if not config["enable_chunked_prefill"]:
                assert req.num_computed_tokens == req.num_tokens  # never split without chunking
        ro = runner.execute(so)
        s.abort_requests(aborts_in_flight)
        for out in s.update(so, ro):
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.req_id] = out.finish_reason
        check_blocks(s)
        if step > 6 and not s.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"livelock: {list(s.requests.values())}")

    aborted = {rid for g in groups if g["abort"] is not None and g["id"] in members for rid in members[g["id"]]}
    for g in groups:
        ref = reference_outputs(g["prompt"], g["max_tokens"], config["max_model_len"], g["eos"])
        for rid in members[g["id"]]:
            got = tokens.get(rid, [])
            if rid in aborted and rid not in reasons:
                assert got == ref[: len(got)]
            else:
                assert got == ref, rid
                assert reasons[rid] == ("stop" if ref[-1] in g["eos"] else "length")
    assert s.kv_cache_manager.num_used_blocks == 0
    assert s.kv_cache_manager.num_free_cpu_blocks == config["num_cpu_blocks"]
