"""`--max-parallel-loading-workers`: tensor-parallel ranks read their weights in waves of at most N ranks
(`collectives.in_waves`), and a TP=2 engine loaded one rank at a time serves the same tokens as one rank."""

from __future__ import annotations

import threading
import time

import pytest

from aserve.distributed.collectives import in_waves
from aserve.distributed.context import ParallelContext


def _run_ranks(world: int, max_at_once: int | None) -> tuple[int, list[tuple[int, str]]]:
    """Run `in_waves` on `world` threads standing in for ranks; (most loads at once, event log)."""
    barrier = threading.Barrier(world)
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    events: list[tuple[int, str]] = []

    def rank_main(rank: int) -> None:
        def work() -> None:
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                events.append((rank, "start"))
            time.sleep(0.05)
            with lock:
                state["now"] -= 1
                events.append((rank, "end"))

        in_waves(work, ParallelContext(tp_rank=rank, tp_size=world), max_at_once, barrier=barrier.wait)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return state["most"], events


@pytest.mark.parametrize("world, max_at_once, most", [(4, 1, 1), (4, 2, 2), (3, 2, 2), (4, None, 4), (2, 8, 2)])
def test_at_most_n_ranks_load_at_once(world, max_at_once, most):
    got, events = _run_ranks(world, max_at_once)
    assert got == most
    assert sorted(r for r, e in events if e == "start") == list(range(world))  # every rank loaded once
    if max_at_once == 1:  # waves in rank order, each finished before the next starts
        assert events == [(r, e) for r in range(world) for e in ("start", "end")]


def test_one_rank_just_works():
    calls = []
    in_waves(lambda: calls.append(1), ParallelContext(), 1, barrier=lambda: pytest.fail("no barrier with one rank"))
    assert calls == [1]


@pytest.mark.timeout(180)
def test_tp2_loaded_one_rank_at_a_time_matches_one_rank(tiny_llama):
    from tests.e2e.test_hf_equivalence import PROMPTS, _generate, _llm

    one_rank = _generate(_llm(tiny_llama), PROMPTS)
    llm = _llm(tiny_llama, tensor_parallel_size=2, max_parallel_loading_workers=1)
    try:
        assert llm.engine.config.load.options.max_parallel_loading_workers == 1
        assert _generate(llm, PROMPTS) == one_rank
    finally:
        llm.engine.shutdown()
