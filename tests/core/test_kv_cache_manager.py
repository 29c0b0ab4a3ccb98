import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aserve.core.kv_cache_manager import KVCacheManager
from aserve.core.request import Request, RequestStatus
from aserve.sampling_params import SamplingParams

BS = 4


def req(req_id, tokens, share_prefix=False, **params):
    return Request(req_id, list(tokens), SamplingParams(max_tokens=100, **params), share_prefix=share_prefix)


def admit(kv, r):
    """What the scheduler does for a waiting request: prefix lookup, then allocate the rest."""
    blocks, num_cached = kv.get_computed_blocks(r)
    new = kv.allocate_slots(r, r.num_tokens - num_cached, blocks)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return new, num_cached


def test_allocate_returns_only_new_blocks_and_none_when_full():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=False)
    r = req("a", range(6))
    new = kv.allocate_slots(r, 6)
    assert len(new) == 2 and kv.get_block_ids("a") == new
    r.num_computed_tokens = 6
    assert kv.allocate_slots(r, 2) == []  # still fits in block 2
    r.num_computed_tokens = 8
    assert len(kv.allocate_slots(r, 1)) == 1
    r.num_computed_tokens = 9
    assert kv.num_free_blocks == 1 and kv.num_used_blocks == 3
    assert kv.allocate_slots(r, 8) is None  # needs 2, 1 free: nothing changes
    assert len(kv.get_block_ids("a")) == 3 and kv.num_free_blocks == 1
    assert kv.usage == pytest.approx(3 / 4)
    kv.free(r)
    assert kv.num_free_blocks == 4 and kv.get_block_ids("a") == [] and kv.usage == 0.0


def test_prefix_hit_shares_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = req("a", range(12))
    admit(kv, a)
    b = req("b", range(12))
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8 and blocks == kv.get_block_ids("a")[:2]  # 3rd block would leave nothing to compute
    new = kv.allocate_slots(b, 4, blocks)
    assert len(new) == 1 and kv.get_block_ids("b") == blocks + new
    assert [kv.pool.ref_cnt(x) for x in blocks] == [2, 2]
    assert kv.prefix_cache_queries == 24 and kv.prefix_cache_hits == 8
    c = req("c", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9])
    assert kv.get_computed_blocks(c)[1] == 4  # diverges in block 2


def test_freed_cached_blocks_are_found_again_and_counted_as_free():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = req("a", range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 3
    b = req("b", range(9))
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert kv.allocate_slots(b, 1, blocks) is not None  # 2 cached free blocks revived + 1 new
    assert kv.num_free_blocks == 0


def test_hit_blocks_that_are_free_count_against_room():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = req("a", range(9))
    admit(kv, a)
    kv.free(a)
    other = req("o", [40] * 4)
    admit(kv, other)  # takes the uncached block; the 2 cached ones stay free
    b = req("b", range(9))
    blocks, _ = kv.get_computed_blocks(b)
    assert len(blocks) == 2
    assert kv.allocate_slots(b, 1, blocks) is None  # 2 revived + 1 new > 2 free
    assert all(kv.pool.is_free(x) for x in blocks)


def test_no_sharing_without_caching_unless_share_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = req("a", range(9))
    admit(kv, a)
    assert kv.get_computed_blocks(req("b", range(9))) == ([], 0)
    lead = req("l", range(20, 29), share_prefix=True)
    admit(kv, lead)
    sib = req("s", range(20, 29), share_prefix=True)
    blocks, n = kv.get_computed_blocks(sib)
    assert n == 8 and blocks == kv.get_block_ids("l")[:2]
    kv.allocate_slots(sib, 1, blocks)
    assert kv.prefix_cache_queries == 0  # stats only count the prefix cache proper
    kv.free(lead)
    kv.free(sib)
    assert kv.get_computed_blocks(req("t", range(20, 29), share_prefix=True)) == ([], 0)  # dropped at free


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    admit(kv, req("a", range(9)))
    assert kv.get_computed_blocks(req("b", range(9), prompt_logprobs=1)) == ([], 0)


def test_blocks_of_uncomputed_tokens_lose_their_hash_on_release():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = req("a", range(9))
    assert kv.allocate_slots(a, 9) is not None  # registered while scheduled ...
    assert kv.get_computed_blocks(req("x", range(9)))[1] == 8
    kv.free(a)  # ... but preempted before they were computed (num_computed_tokens is 0)
    assert kv.get_computed_blocks(req("y", range(9))) == ([], 0)
    b = req("b", range(9))
    admit(kv, b)
    b.status = RequestStatus.FINISHED_ERROR  # a failed step: its KV is not trusted
    kv.free(b)
    assert kv.get_computed_blocks(req("z", range(9))) == ([], 0)


def test_swap_round_trip():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True, num_cpu_blocks=3)
    a = req("a", range(10))
    admit(kv, a)
    dev = list(kv.get_block_ids("a"))
    assert kv.can_swap_out(a)
    pairs = kv.swap_out(a)
    assert [d for d, _ in pairs] == dev and kv.get_block_ids("a") == []
    assert kv.num_free_blocks == 5 and kv.num_free_cpu_blocks == 0
    cpu = kv.get_cpu_block_ids("a")
    assert [c for _, c in pairs] == cpu
    assert kv.can_swap_in(a) and not kv.can_swap_in(a, num_new_tokens=100)
    back = kv.swap_in(a)
    assert [c for c, _ in back] == cpu
    assert kv.get_block_ids("a") == [d for _, d in back] and kv.num_free_cpu_blocks == 3
    b = req("b", range(10))
    assert kv.get_computed_blocks(b)[1] == 8  # the swapped-in blocks are registered again
    kv.free(a)
    assert kv.num_free_blocks == 5


def test_cannot_swap_out_without_cpu_room_and_free_releases_cpu_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False, num_cpu_blocks=2)
    a = req("a", range(10))
    admit(kv, a)
    assert not kv.can_swap_out(a)
    b = req("b", range(6))
    admit(kv, b)
    kv.swap_out(b)
    assert kv.num_free_cpu_blocks == 0
    kv.free(b)
    assert kv.num_free_cpu_blocks == 2 and kv.num_free_blocks == 2


def test_argument_errors():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0, True)
    kv = KVCacheManager(8, BS, True)
    a = req("a", range(9))
    admit(kv, a)
    with pytest.raises(ValueError, match="computed_block_ids"):
        kv.allocate_slots(a, 1, [1])


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions (with prefix hits), decodes, frees, preemptions and swaps."""

    def __init__(self):
        super().__init__()
        self.kv = None
        self.live: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.counter = 0

    @precondition(lambda self: self.kv is None)
    @rule(caching=st.booleans(), num_blocks=st.integers(4, 16))
    def init(self, caching, num_blocks):
        self.kv = KVCacheManager(num_blocks, BS, caching, num_cpu_blocks=6)

    @precondition(lambda self: self.kv is not None)
    @rule(prefix=st.sampled_from([(), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8)]),
          tail=st.lists(st.integers(0, 2), max_size=7), share=st.booleans())
    def add(self, prefix, tail, share):
        tokens = list(prefix) + tail or [0]
        self.counter += 1
        r = req(f"r{self.counter}", tokens, share_prefix=share)
        blocks, num_cached = self.kv.get_computed_blocks(r)
        assert num_cached < r.num_tokens
        for i, b in enumerate(blocks):  # a hit holds exactly the request's tokens
            assert self.kv.pool.block_token_ids(b) == tuple(tokens[i * BS:(i + 1) * BS])
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(r, r.num_tokens - num_cached, blocks)
        if new is None:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_ids(r.request_id) == []
        else:
            r.num_computed_tokens = r.num_tokens
            r.status = RequestStatus.RUNNING
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2), num_new=st.integers(1, 5))
    def decode(self, data, token, num_new):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        r.append_output_token_ids([token] * num_new)
        if self.kv.allocate_slots(r, num_new) is not None:
            r.num_computed_tokens += num_new
        else:
            del r.output_token_ids[-num_new:]
            del r.all_token_ids[-num_new:]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "preempt"]))
    def release(self, data, how):
        r = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        r.status = {"finish": RequestStatus.FINISHED_STOPPED, "abort": RequestStatus.FINISHED_ABORTED,
                    "preempt": RequestStatus.PREEMPTED}[how]
        self.kv.free(r)
        if how == "preempt":
            r.num_computed_tokens = 0
        assert self.kv.get_block_ids(r.request_id) == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def swap_out(self, data):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        if self.kv.can_swap_out(r):
            pairs = self.kv.swap_out(r)
            assert len({c for _, c in pairs}) == len(pairs)
            del self.live[r.request_id]
            self.swapped[r.request_id] = r

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        r = self.swapped[data.draw(st.sampled_from(sorted(self.swapped)))]
        if self.kv.can_swap_in(r):
            n = len(self.kv.get_cpu_block_ids(r.request_id))
            assert len(self.kv.swap_in(r)) == n
            del self.swapped[r.request_id]
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def double_free_raises(self, data):
        r = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        blocks = self.kv.get_block_ids(r.request_id)
        if blocks and self.kv.pool.ref_cnt(blocks[0]) == 1:
            self.kv.pool.free([blocks[0]])
            try:
                self.kv.pool.free([blocks[0]])
            except AssertionError:
                pass
            else:
                raise AssertionError("double free not detected")
            self.kv.pool.touch([blocks[0]])  # restore

    @invariant()
    def consistent(self):
        kv = self.kv
        if kv is None:
            return
        pool = kv.pool
        assert kv.num_free_blocks + kv.num_used_blocks == pool.num_blocks - 1
        counts = [0] * pool.num_blocks
        for r in self.live.values():
            table = kv.get_block_ids(r.request_id)
            assert len(table) * BS >= r.num_computed_tokens
            for i, b in enumerate(table):
                counts[b] += 1
                # A hashed block inside the computed part holds exactly this request's tokens.
                if pool.block_hash(b) is not None and (i + 1) * BS <= r.num_computed_tokens:
                    assert pool.block_token_ids(b) == tuple(r.all_token_ids[i * BS:(i + 1) * BS])
                    assert pool.block_hash(b) == r.block_hashes[i]
        for b in range(1, pool.num_blocks):
            assert pool.ref_cnt(b) == counts[b], (b, pool.ref_cnt(b), counts[b])
            assert pool.is_free(b) == (counts[b] == 0)
        cpu = [c for r in self.swapped.values() for c in kv.get_cpu_block_ids(r.request_id)]
        assert len(cpu) == len(set(cpu)) and len(cpu) + kv.num_free_cpu_blocks == kv.num_cpu_blocks
        for r in self.swapped.values():
            assert kv.get_block_ids(r.request_id) == []


KVCacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
