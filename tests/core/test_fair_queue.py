"""Fair sharing between clients: one client's burst cannot starve another's requests."""

from aserve.core.fair_queue import FairQueue
from tests.core.core_fakes import Driver, make_request, make_scheduler


def _req(req_id: str, client: str | None, prompt: int = 4, max_tokens: int = 4):
    req = make_request(req_id, prompt, max_tokens=max_tokens)
    req.client_id = client
    return req


def test_key_b_is_scheduled_in_the_next_step_with_room_despite_200_of_key_a_waiting():
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=256, max_model_len=64)
    for i in range(200):
        s.add_request(_req(f"a{i}", "key-a", max_tokens=3))
    d = Driver(s)
    d.step()  # the batch fills with key A's first four
    assert {r.client_id for r in s.running} == {"key-a"} and len(s.waiting) == 196
    s.add_request(_req("b0", "key-b", max_tokens=3))
    scheduled_b_at = None
    for step in range(1, 10):
        has_room = len(s.running) < s.max_num_seqs
        so, _ = d.step()
        if has_room:  # the first step with room must take B's request, whatever key A has waiting
            assert "b0" in so.scheduled_req_ids
            scheduled_b_at = step
            break
        assert "b0" not in so.scheduled_req_ids
    assert scheduled_b_at is not None
    # Key A's four finish after their 3rd token: the step after that is the first with room, and B is in it.
    assert scheduled_b_at == 3
    assert len(s.waiting) == 196 - 3  # the other three free slots went to key A, in order
    assert [r.request_id for r in s.running if r.client_id == "key-a"] == ["a4", "a5", "a6"]


def test_without_client_ids_the_queue_is_first_come_first_served():
    s = make_scheduler(max_num_seqs=2, num_blocks=256)
    for i in range(6):
        s.add_request(_req(f"r{i}", None, max_tokens=2))
    d = Driver(s)
    order = []
    while s.has_unfinished_requests():
        so, _ = d.step()
        order += [r for r in so.scheduled_req_ids if r not in order]
    assert order == [f"r{i}" for i in range(6)]


def test_two_flooding_clients_share_the_batch_evenly():
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=256)
    for i in range(40):
        s.add_request(_req(f"a{i}", "a", max_tokens=2))
    for i in range(40):
        s.add_request(_req(f"b{i}", "b", max_tokens=2))
    d = Driver(s)
    for _ in range(20):
        so, _ = d.step()
        per_client = [sum(r.startswith(c) for r in so.scheduled_req_ids) for c in ("a", "b")]
        assert per_client == [2, 2], per_client


def test_queue_operations_keep_per_client_order_and_put_back_in_front():
    q = FairQueue()
    reqs = [_req("a0", "a"), _req("a1", "a"), _req("b0", "b")]
    for r in reqs:
        q.add(r)
    q.start_step([_req("x", "a")])  # client a already has one running
    assert q.peek().request_id == "b0"
    first = q.pop()
    assert first.request_id == "b0" and q.peek().request_id == "a0"  # now 1 running each: a0 arrived first
    second = q.pop()
    q.add_front_all([second])  # popped but not admitted: back in front, no longer counted
    assert q.peek() is second and len(q) == 2
    q.remove(reqs[1])
    assert [r.request_id for r in q] == ["a0"] and len(q) == 1
    preempted = _req("p", "b")
    q.add_front(preempted)
    assert next(iter(q)).request_id == "p"
